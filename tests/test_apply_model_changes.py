"""The correction follows the model it was applied to when that model changes or is copied:
``resize_token_embeddings`` puts a new LM head in place of the hooked one, and ``copy.deepcopy``
copies the hooks along with the model. Logits are checked against the float64 reference of
``test_apply_handle``."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from test_apply_handle import ids, logits, model, reference, state, surgery  # noqa: F401

from mergekit_darts import apply_surgery

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
