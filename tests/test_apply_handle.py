"""One surgery handle per model: applying twice replaces, ``set_task``, ``disabled()``, and no
correction outside a forward call. Logits are checked against a float64 reference written here."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny import random_modules, write_surgery
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import apply_surgery, load_surgery
from mergekit_darts.correction.darts_correction import correction_module
from mergekit_darts.errors import SurgeryFormatError

RANK, MAX_POSITIONS = 4, 6  # the prompt runs past the table: rows outside it get no position term
KINDS = {"math": "pos_corr", "code": "standard"}


@pytest.fixture(scope="module")
def surgery(tiny_family: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    hidden = AutoModelForCausalLM.from_pretrained(tiny_family.base).config.hidden_size
    modules = random_modules(KINDS, hidden, RANK, MAX_POSITIONS)
    return write_surgery(tmp_path_factory.mktemp("handle") / "surgery", modules)


@pytest.fixture()
def model(tiny_family: Any) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_family.base, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ids(tiny_family: Any) -> torch.Tensor:
    tokenizer = AutoTokenizer.from_pretrained(tiny_family.base)
    ids = tokenizer(tiny_family.prompts[5], return_tensors="pt")["input_ids"]
    assert ids.shape[1] > MAX_POSITIONS
    return ids


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0].double()


def reference(model: Any, ids: torch.Tensor, state: dict[str, torch.Tensor], times: int = 1):
    """Logits of ``h - times * (W_up relu(W_down h) + b_p)`` in float64, from the plain model's
    final hidden state (call it with no surgery applied); b_p = 0 at p >= MAX_POSITIONS."""
    with torch.no_grad():
        h = model(ids, output_hidden_states=True).hidden_states[-1][0].double()
    s = {k: v.detach().double() for k, v in state.items()}
    rows = torch.zeros_like(h)  # b_p, zero at and past MAX_POSITIONS
    if "position_bias" in s:
        rows[:MAX_POSITIONS] = s["position_bias"][: min(len(h), MAX_POSITIONS)]
    out = h
    for _ in range(times):  # twice: what two stacked hooks would compute
        out = out - torch.relu(out @ s["down.weight"].T) @ s["up.weight"].T - rows
    return out @ model.get_output_embeddings().weight.detach().double().T


def state(surgery: Path, task: str) -> dict[str, torch.Tensor]:
    return load_surgery(surgery, task).state_dict()


def test_applying_twice_replaces_the_first(model: Any, ids: torch.Tensor, surgery: Path) -> None:
    math = state(surgery, "math")
    once, twice = reference(model, ids, math), reference(model, ids, math, times=2)
    assert (once - twice).abs().max() > 1e-2  # stacking would be visible
    first = apply_surgery(model, surgery, "math")
    with pytest.warns(UserWarning, match="replaced"):
        second = apply_surgery(model, surgery, "math")
    torch.testing.assert_close(logits(model, ids), once, rtol=0, atol=1e-4)
    first.remove()  # already removed: the second handle's hooks stay
    torch.testing.assert_close(logits(model, ids), once, rtol=0, atol=1e-4)
    second.remove()
    plain = reference(model, ids, {k: torch.zeros_like(v) for k, v in math.items()})
    torch.testing.assert_close(logits(model, ids), plain, rtol=0, atol=1e-4)


def test_set_task_and_disabled(model: Any, ids: torch.Tensor, surgery: Path) -> None:
    expected = {task: reference(model, ids, state(surgery, task)) for task in KINDS}
    plain = logits(model, ids)
    handle = apply_surgery(model, surgery, "math")
    torch.testing.assert_close(logits(model, ids), expected["math"], rtol=0, atol=1e-4)
    handle.set_task("code")
    torch.testing.assert_close(logits(model, ids), expected["code"], rtol=0, atol=1e-4)
    with handle.disabled():
        assert torch.equal(logits(model, ids), plain)
    torch.testing.assert_close(logits(model, ids), expected["code"], rtol=0, atol=1e-4)
    handle.set_task("none")
    assert torch.equal(logits(model, ids), plain)
    with pytest.raises(SurgeryFormatError, match=r"no surgery task 'maths' in .*; available: math"):
        handle.set_task("maths")
    handle.remove()


def test_set_task_needs_a_folder(model: Any, surgery: Path) -> None:
    handle = apply_surgery(model, load_surgery(surgery, "math"))
    with pytest.raises(ValueError, match="applied with a module, not a surgery folder"):
        handle.set_task("code")


def test_the_head_called_outside_a_forward_call_is_left_alone(
    model: Any, ids: torch.Tensor, surgery: Path
) -> None:
    """A forward call's positions end with it: a later direct head call is not corrected with
    them (the bug: apply.py kept them, so this call got the last call's position rows)."""
    with apply_surgery(model, surgery, "math"):
        logits(model, ids)
        h = torch.randn(1, ids.shape[1], model.config.hidden_size)
        head = model.get_output_embeddings()
        with torch.no_grad():
            direct = head(h).double()
        expected = h.double() @ head.weight.detach().double().T
        torch.testing.assert_close(direct, expected, rtol=0, atol=1e-4)


def test_an_export_is_not_corrected_twice(model: Any, surgery: Path) -> None:
    model.darts_surgery = correction_module("none", model.config.hidden_size, RANK, MAX_POSITIONS)
    with pytest.raises(ValueError, match="is a DARTS export that applies its own surgery"):
        apply_surgery(model, surgery, "math")


# ------------------------------------------------------------------------------------------------
# The correction follows the model it was applied to when that model changes or is copied:
# ``resize_token_embeddings`` puts a new LM head in place of the hooked one, and ``copy.deepcopy``
# copies the hooks along with the model. Logits are checked against the float64 reference of
# ``test_apply_handle``.


ADDED = 8  # rows resize_token_embeddings adds to the vocabulary


def test_resizing_the_embeddings_keeps_the_correction(
    model: Any,  # noqa: F811
    ids: torch.Tensor,  # noqa: F811
    surgery: Path,  # noqa: F811
) -> None:
    assert not model.config.tie_word_embeddings  # an untied head: the resize replaces it
    expected = reference(model, ids, state(surgery, "math"))
    plain = logits(model, ids)
    handle = apply_surgery(model, surgery, "math")
    before = logits(model, ids)
    torch.testing.assert_close(before, expected, rtol=0, atol=1e-4)
    assert (before - plain).abs().max() > 0.1  # the correction is visible

    head = model.get_output_embeddings()
    vocab = head.out_features
    model.resize_token_embeddings(vocab + ADDED)
    assert model.get_output_embeddings() is not head
    after = logits(model, ids)
    assert after.shape[-1] == vocab + ADDED
    assert (after[:, :vocab] - before).abs().max() <= 1e-5
    generated = model.generate(ids, max_new_tokens=3, do_sample=False)  # cached steps too
    assert generated.shape[1] == ids.shape[1] + 3

    handle.remove()  # from the new head as well: the plain model again
    assert (logits(model, ids)[:, :vocab] - plain).abs().max() <= 1e-5
    with torch.no_grad():  # and the discarded head no longer corrects anything
        h = torch.randn(1, ids.shape[1], model.config.hidden_size)
        assert torch.equal(head(h), torch.nn.functional.linear(h, head.weight))


def test_a_copy_of_a_corrected_model_is_corrected_once(
    model: Any,  # noqa: F811
    ids: torch.Tensor,  # noqa: F811
    surgery: Path,  # noqa: F811
) -> None:
    math, code = state(surgery, "math"), state(surgery, "code")
    once, twice = reference(model, ids, math), reference(model, ids, math, times=2)
    assert (once - twice).abs().max() > 1e-2  # stacking would be visible
    expected_code = reference(model, ids, code)
    plain = logits(model, ids)
    handle = apply_surgery(model, surgery, "math")

    twin = copy.deepcopy(model)
    torch.testing.assert_close(logits(twin, ids), once, rtol=0, atol=1e-4)  # copied as it is
    with pytest.warns(UserWarning, match="replaced"):
        twin_handle = apply_surgery(twin, surgery, "math")
    torch.testing.assert_close(logits(twin, ids), once, rtol=0, atol=1e-4)
    twin_handle.set_task("code")
    torch.testing.assert_close(logits(twin, ids), expected_code, rtol=0, atol=1e-4)
    torch.testing.assert_close(logits(model, ids), once, rtol=0, atol=1e-4)  # left alone

    handle.remove()
    assert torch.equal(logits(model, ids), plain)
    torch.testing.assert_close(logits(twin, ids), expected_code, rtol=0, atol=1e-4)
    twin_handle.remove()
    assert torch.equal(logits(twin, ids), plain)
