"""``mergekit_darts.apply_surgery`` under ``model.generate``: left padding, KV cache, logits_to_keep."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from tiny import random_module
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import SurgeryHandle, SurgeryModule, apply_surgery, build_module

MAX_POSITIONS = 10  # shorter than prompt + generation: positions past the table are exercised
STEPS = 8


@pytest.fixture(scope="module")
def setup(tiny_family: Any) -> Iterator[tuple[Any, Any, SurgeryModule, SurgeryHandle]]:
    model = AutoModelForCausalLM.from_pretrained(tiny_family.base, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_family.base, padding_side="left")
    module = random_module("pos_corr", model.config.hidden_size, 4, MAX_POSITIONS, seed=0)
    handle = apply_surgery(model, module)
    yield model, tokenizer, module, handle
    handle.remove()


def generate(model: Any, tokenizer: Any, prompts: list[str]) -> tuple[list[list[int]], Any]:
    """Greedy new tokens per prompt (cut after EOS) and the raw per-step logits [B, steps, V]."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(
        **batch,
        max_new_tokens=STEPS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    new = out.sequences[:, batch["input_ids"].shape[1] :].tolist()
    eos = tokenizer.eos_token_id
    cut = [row[: row.index(eos) + 1] if eos in row else row for row in new]
    return cut, torch.stack(out.logits, dim=1)


def test_generate_does_not_depend_on_batch_or_padding(setup: tuple, tiny_family: Any) -> None:
    model, tokenizer, _, handle = setup
    prompts = tiny_family.prompts[:6]
    assert len({len(tokenizer(p)["input_ids"]) for p in prompts}) > 2  # really left-padded
    tokens, logits = generate(model, tokenizer, prompts)
    for i, prompt in enumerate(prompts):
        alone, alone_logits = generate(model, tokenizer, [prompt])
        assert tokens[i] == alone[0]
        steps = len(alone[0])
        torch.testing.assert_close(logits[i, :steps], alone_logits[0, :steps], rtol=0, atol=1e-5)
        # and the cached decode steps see the positions a cache-free forward sees
        ids = tokenizer(prompt)["input_ids"] + alone[0]
        with torch.no_grad():
            fresh = model(torch.tensor([ids[:-1]])).logits[0, -steps:]
        torch.testing.assert_close(alone_logits[0, :steps], fresh, rtol=0, atol=1e-5)

    handle.module, module = None, handle.module
    try:
        plain_tokens, plain_logits = generate(model, tokenizer, prompts)
    finally:
        handle.module = module
    assert (plain_logits[:, 0] - logits[:, 0]).abs().max() > 0.5
    assert plain_tokens != tokens


def test_left_padding_uses_each_sequence_own_positions(setup: tuple, tiny_family: Any) -> None:
    model, tokenizer, _, _ = setup
    prompts = tiny_family.prompts[:4]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        padded = model(**batch).logits
        for i, prompt in enumerate(prompts):
            alone = model(**tokenizer([prompt], return_tensors="pt")).logits[0]
            torch.testing.assert_close(padded[i, -len(alone) :], alone, rtol=0, atol=1e-5)


def test_positional_arguments_are_read_by_name(setup: tuple, tiny_family: Any) -> None:
    """``model(ids, mask)``: the left-padding mask counts even when passed positionally."""
    model, tokenizer, _, _ = setup
    batch = tokenizer(tiny_family.prompts[:4], return_tensors="pt", padding=True)
    assert not batch["attention_mask"].all()
    with torch.no_grad():
        positional = model(batch["input_ids"], batch["attention_mask"]).logits
        assert torch.equal(positional, model(**batch).logits)


def test_manual_decoding_with_a_cache_and_no_position_ids(setup: tuple, tiny_family: Any) -> None:
    """Outside ``generate`` nobody passes positions: the cache length must supply them."""
    model, tokenizer, _, _ = setup
    ids = tokenizer(tiny_family.prompts[5], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :3], use_cache=True)
        key = "cache" if hasattr(out, "cache") else "past_key_values"  # transformers 5.19 name
        steps = [out.logits]
        for t in range(3, ids.shape[1]):
            out = model(ids[:, t : t + 1], **{key: getattr(out, key)}, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("keep", [1, 3, "indices"])
def test_logits_to_keep(setup: tuple, tiny_family: Any, keep: int | str) -> None:
    model, tokenizer, _, _ = setup
    batch = tokenizer(tiny_family.prompts[:4], return_tensors="pt", padding=True)
    width = batch["input_ids"].shape[1]
    index = torch.tensor([0, 2, width - 1]) if keep == "indices" else slice(width - keep, None)
    with torch.no_grad():
        full = model(**batch).logits
        kept = model(**batch, logits_to_keep=index if keep == "indices" else keep).logits
    torch.testing.assert_close(kept, full[:, index], rtol=0, atol=1e-5)


def test_correction_stays_float32_under_autocast(setup: tuple, tiny_family: Any) -> None:
    """lm-eval's ``mixed_precision_dtype`` runs the model under autocast; the module must not."""
    model, tokenizer, module, _ = setup
    seen: dict[str, torch.Tensor] = {}
    probe = model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: seen.update(h_hat=args[0])
    )
    ids = tokenizer(tiny_family.prompts[:1], return_tensors="pt")["input_ids"]
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            h = model(ids, output_hidden_states=True).hidden_states[-1]
    finally:
        probe.remove()
    with torch.no_grad():
        expected = module(h.float(), torch.arange(ids.shape[1])[None])
    torch.testing.assert_close(seen["h_hat"].float(), expected, rtol=0, atol=1e-6)


def test_remove_restores_the_plain_model(tiny_family: Any) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_family.base, dtype=torch.float32).eval()
    ids = torch.tensor([[2, 10, 11, 12, 13]])
    module = build_module("pos_corr", model.config.hidden_size, 4, MAX_POSITIONS, seed=1)
    with torch.no_grad():
        module.position_bias.normal_()
        before = model(ids).logits
        with apply_surgery(model, module):
            during = model(ids).logits
        after = model(ids).logits
    assert torch.equal(before, after) and not torch.allclose(before, during)
