"""The real output path: head bias (phi), logits_scaling (granite), softcapping (gemma2).

Each tiny model is built locally from its transformers config, and the head recorded by
``capture`` must reproduce the model's own logits, which ``h @ W.T`` alone does not.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaForCausalLM,
    PhiConfig,
    PhiForCausalLM,
)

from mergekit_darts import build_module
from mergekit_darts.calibrate.capture import Captured, capture
from mergekit_darts.calibrate.selection import held_out_metrics
from mergekit_darts.calibrate.train import TrainSettings, train_surgery
from mergekit_darts.correction import head as head_module
from mergekit_darts.correction.head import OutputHead
from mergekit_darts.errors import HeadError

VOCAB, HIDDEN = 48, 32
SEQUENCES = [[2, 5, 9, 11, 7, 30], [2, 17, 4], [2, 40, 41, 42, 43], [2, 8, 8, 8, 8, 8, 9]]
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,
)


def _phi(seed: int) -> PhiForCausalLM:
    torch.manual_seed(seed)
    model = PhiForCausalLM(PhiConfig(**SMALL)).eval()
    with torch.no_grad():  # a visible bias: HF initialises it to zero
        model.lm_head.bias.copy_(torch.randn(VOCAB) * 2)
    return model


def _granite(seed: int) -> GraniteForCausalLM:
    torch.manual_seed(seed)
    return GraniteForCausalLM(GraniteConfig(**SMALL, logits_scaling=4.0)).eval()


def _gemma2(seed: int) -> Gemma2ForCausalLM:
    torch.manual_seed(seed)
    config = Gemma2Config(**SMALL, head_dim=8, query_pre_attn_scalar=8, final_logit_softcapping=0.1)
    return Gemma2ForCausalLM(config).eval()


BUILDERS = {"phi": _phi, "granite": _granite, "gemma2": _gemma2}


def _reference(model, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own logits and final hidden state for one unpadded sequence."""
    with torch.no_grad():
        out = model(torch.tensor([seq]), output_hidden_states=True)
    return out.logits[0].double(), out.hidden_states[-1][0].double()


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_head_reproduces_the_models_own_logits(arch):
    model = BUILDERS[arch](0)
    got = capture(
        model, SEQUENCES, batch_size=2, with_head=True, cache_dtype=torch.float32, progress=False
    )
    assert got.head.verified and got.head.max_error < 1e-5
    for row, seq in enumerate(SEQUENCES):
        logits, hidden = _reference(model, seq)
        ours = got.head.logits(got.hidden[row, : len(seq)]).double()
        torch.testing.assert_close(ours, logits, rtol=1e-5, atol=1e-5)
        # the transform matters: the bare matmul is far from the model's logits
        bare = hidden @ model.lm_head.weight.double().T
        assert (bare - logits).abs().max() > 0.1


def test_transforms_are_read_from_each_architecture():
    phi, granite, gemma = (OutputHead.of(BUILDERS[a](0)) for a in ("phi", "granite", "gemma2"))
    assert phi.bias is not None and phi.scale == 1.0 and phi.softcap is None
    assert granite.bias is None and granite.scale == 0.25 and granite.softcap is None
    assert gemma.bias is None and gemma.scale == 1.0 and gemma.softcap == 0.1
    # softcap in float64 by hand: c * tanh(x / c)
    h = torch.randn(3, HIDDEN, dtype=torch.float64)
    x = h @ gemma.weight.double().T
    torch.testing.assert_close(
        gemma.logits(h).double(), 0.1 * torch.tanh(x / 0.1), rtol=1e-5, atol=1e-6
    )


class ScaledLlama(LlamaForCausalLM):
    """An architecture mergekit-darts does not know: its logits are tripled after the head."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits * 3
        return out


def test_unknown_output_path_refuses_logit_losses_but_not_l1(tiny_family):
    models = [
        ScaledLlama.from_pretrained(p, dtype=torch.float32)
        for p in (tiny_family.base, tiny_family.math)
    ]
    merged = capture(
        models[0], SEQUENCES, with_head=True, cache_dtype=torch.float32, progress=False
    )
    target = capture(
        models[1],
        SEQUENCES,
        with_head=True,
        with_entropy=True,
        cache_dtype=torch.float32,
        progress=False,
    )
    assert merged.head.verified is False and merged.head.max_error > 0.1
    module = build_module("pos_corr", merged.hidden.shape[-1], 4, 16, seed=0)
    for loss in ("kl", "ce"):
        with pytest.raises(HeadError, match=f"the {loss} loss needs .*ScaledLlama") as err:
            train_surgery(module, merged, target, TrainSettings(loss=loss, steps=2), progress=False)
        assert "\n" not in str(err.value)
    for loss in ("l1", "ewl1"):
        train_surgery(module, merged, target, TrainSettings(loss=loss, steps=2), progress=False)


def test_head_survives_storage_as_tensors():
    head = OutputHead.of(_phi(0))
    head.verified, head.max_error = True, 1e-7
    again = OutputHead.from_tensors(head.tensors())
    assert torch.equal(again.weight, head.weight) and torch.equal(again.bias, head.bias)
    assert (again.scale, again.softcap, again.model_class, again.verified) == (
        1.0,
        None,
        "PhiForCausalLM",
        True,
    )


@pytest.mark.slow
def test_ce_with_the_real_biased_head_moves_the_merge_towards_its_target():
    """A head's bias is part of the output path: without it, ce trains the phi merge away from its target."""
    merged_model, target_model = _phi(0), _phi(0)
    with torch.no_grad():  # the "fine-tune": a different head bias and perturbed final layers
        target_model.lm_head.bias.copy_(
            torch.randn(VOCAB, generator=torch.Generator().manual_seed(5)) * 2
        )
        for p in target_model.model.final_layernorm.parameters():
            p.add_(0.3 * torch.randn_like(p))
    seqs = [
        [2, *torch.randint(4, VOCAB, (12,), generator=torch.Generator().manual_seed(i)).tolist()]
        for i in range(16)
    ]
    merged = capture(merged_model, seqs, with_head=True, cache_dtype=torch.float32, progress=False)
    target = capture(target_model, seqs, with_head=True, cache_dtype=torch.float32, progress=False)
    settings = TrainSettings(loss="ce", steps=150, lr=1e-2, batch_size=4)

    def fit(m: Captured, t: Captured):
        module = build_module("standard", HIDDEN, 8, 16, seed=0)
        result = train_surgery(module, m, t, settings, progress=False)
        return held_out_metrics(result.module, merged, target, merged.mask)  # real heads

    real = fit(merged, target)
    assert real.agreement_after > real.agreement_before + 0.5 and real.kl_after < real.kl_before
    # the old `h @ W.T`: trained against the wrong logits, the merge drifts away from its target
    bare = [
        dataclasses.replace(c, head=dataclasses.replace(c.head, bias=None))
        for c in (merged, target)
    ]
    old = fit(*bare)
    assert old.kl_after > old.kl_before and old.agreement_after < real.agreement_after


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_bfloat16_models_pass_and_a_missing_transform_fails_the_check(arch, monkeypatch):
    model = BUILDERS[arch](0).to(torch.bfloat16)
    assert capture(model, SEQUENCES, with_head=True, progress=False).head.verified
    if arch == "granite":  # as if its logits_scaling were unknown: caught despite bf16 rounding
        monkeypatch.delitem(head_module.SCALES, "granite")
        assert not capture(model, SEQUENCES, with_head=True, progress=False).head.verified


def test_top1_is_the_argmax_over_every_chunk() -> None:
    """More rows than one chunk: each row's top token matches a float64 argmax of its logits."""
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(50, 8, generator=generator), torch.randn(50, generator=generator)
    head = OutputHead(weight=weight, bias=bias, scale=0.5, softcap=3.0)
    h = torch.randn(2 * head_module.LOGIT_CHUNK + 7, 8, generator=generator)
    logits = torch.tanh(0.5 * (h.double() @ weight.double().T + bias.double()) / 3.0) * 3.0
    assert torch.equal(head.top1(h), logits.argmax(-1))
    assert head.top1(h[:0]).shape == (0,)
