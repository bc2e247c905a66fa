"""Capture on real tiny Llamas, then training: the loss falls and the bias shrinks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import build_module
from mergekit_darts.calibrate.capture import capture
from mergekit_darts.calibrate.selection import fold_split
from mergekit_darts.calibrate.train import (
    TrainSettings,
    positions_of,
    train_stacked,
    train_surgery,
)
from mergekit_darts.correction.metrics import token_entropy


@pytest.fixture(scope="module")
def captured(tiny_family):
    tok = AutoTokenizer.from_pretrained(tiny_family.base)
    sequences = [tok(p)["input_ids"] for p in tiny_family.prompts]
    base = AutoModelForCausalLM.from_pretrained(tiny_family.base, dtype=torch.float32)
    merged = capture(base, sequences, batch_size=4, cache_dtype=torch.float32, progress=False)
    target_model = AutoModelForCausalLM.from_pretrained(tiny_family.math, dtype=torch.float32)
    target = capture(
        target_model,
        sequences,
        batch_size=5,
        with_entropy=True,
        cache_dtype=torch.float32,
        progress=False,
    )
    return sequences, target_model, merged, target


def test_capture_equals_models_own_last_hidden_state(captured):
    sequences, model, _, target = captured
    for row, seq in enumerate(sequences[:4]):
        ids = torch.tensor([seq])
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
        n = len(seq)
        torch.testing.assert_close(
            target.hidden[row, :n], out.hidden_states[-1][0], rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            target.entropy[row, :n], token_entropy(out.logits[0]), rtol=1e-5, atol=1e-5
        )
        assert target.mask[row, :n].all() and not target.mask[row, n:].any()
        assert target.hidden[row, n:].abs().sum() == 0


def test_capture_cache_dtype_default_is_bfloat16(tiny_family):
    model = AutoModelForCausalLM.from_pretrained(tiny_family.base, dtype=torch.float32)
    got = capture(model, [[2, 5, 6], [2, 7]], progress=False)
    assert got.hidden.dtype == torch.bfloat16 and got.entropy is None and got.head is None
    assert got.nbytes == got.hidden.numel() * 2 + got.mask.numel()


def test_positions_of_counts_real_tokens_for_either_padding_side():
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 1, 1, 1]])
    assert positions_of(right).tolist() == [[0, 1, 2, -1], [0, 1, 2, 3]]
    assert positions_of(left).tolist() == [[-1, 0, 1, 2]]


def _train(merged, target, kind="pos_corr", loss="ewl1", steps=60, seed=0):
    hidden = merged.hidden.shape[-1]
    module = build_module(kind, hidden, rank=8, max_positions=32, seed=seed)
    settings = TrainSettings(loss=loss, steps=steps, lr=1e-2, batch_size=4, seed=seed)
    return train_surgery(module, merged, target, settings, progress=False)


@pytest.mark.slow
def test_training_reduces_ewl1_and_gives_positive_rho(captured):
    _, _, merged, target = captured
    result = _train(merged, target)
    assert result.loss_curve[-1] < 0.8 * result.loss_curve[0]
    assert result.rho_l1 > 0.05
    assert result.delta_after.sum() < result.delta_before.sum()
    assert result.delta_before.shape == merged.mask.shape


@pytest.mark.slow
def test_same_seed_same_weights_other_seed_differs(captured):
    _, _, merged, target = captured
    a = _train(merged, target, steps=20, seed=3).module.state_dict()
    b = _train(merged, target, steps=20, seed=3).module.state_dict()
    c = _train(merged, target, steps=20, seed=4).module.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["standard", "add", "parallel", "head", "norm"])
def test_every_module_kind_trains(captured, kind):
    _, _, merged, target = captured
    assert _train(merged, target, kind=kind, loss="l1", steps=40).rho_l1 > 0


@pytest.mark.slow
def test_kl_and_ce_losses_train_with_heads(tiny_family, captured):
    sequences, target_model, _, _ = captured
    base = AutoModelForCausalLM.from_pretrained(tiny_family.base, dtype=torch.float32)
    merged = capture(base, sequences, with_head=True, cache_dtype=torch.float32, progress=False)
    target = capture(
        target_model, sequences, with_head=True, cache_dtype=torch.float32, progress=False
    )
    for loss in ("kl", "ce"):
        result = _train(merged, target, loss=loss, steps=30)
        assert result.loss_curve[-1] < result.loss_curve[0]


def test_mismatched_inputs_are_errors(captured):
    _, _, merged, target = captured
    module = build_module("pos_corr", merged.hidden.shape[-1], 4, 32)
    with pytest.raises(ValueError, match="needs both output heads"):
        train_surgery(module, merged, target, TrainSettings(loss="kl"), progress=False)
    with pytest.raises(ValueError, match="needs the target's entropy"):
        train_surgery(module, merged, merged, TrainSettings(loss="ewl1"), progress=False)
    with pytest.raises(ValueError, match="unknown loss 'mse'"):
        TrainSettings(loss="mse")


@pytest.mark.parametrize("kind", ["standard", "pos_corr", "add", "parallel", "head", "norm"])
@pytest.mark.parametrize("positions", ["all", "late"])
def test_stacked_folds_train_as_one_by_one(captured, kind, positions):
    # cross-fitting's modules trained together equal each trained alone on its rows: 12 prompts,
    # folds of 4 leave 8 rows, batches of 3 (so epochs end on a short, padded batch)
    _, _, merged, target = captured
    folds = fold_split(merged.hidden.shape[0], 3, seed=0)
    every = torch.arange(merged.hidden.shape[0])
    rows = [every[~torch.isin(every, fold)] for fold in folds]
    mask = None
    if positions == "late":  # a loss on late tokens only: some batches count no token at all
        mask = merged.mask & (positions_of(merged.mask) >= 6)
    hidden = merged.hidden.shape[-1]
    settings = TrainSettings("ewl1", 25, 1e-2, 3, 0)

    def module():
        return build_module(kind, hidden, rank=4, max_positions=16, seed=0)

    alone = [
        train_surgery(module(), merged, target, settings, loss_mask=mask, rows=r, progress=False)
        for r in rows
    ]
    together = train_stacked(
        [module() for _ in rows], merged, target, settings, rows, loss_mask=mask, progress=False
    )
    for a, b in zip(alone, together, strict=True):
        for (name, p), q in zip(a.module.named_parameters(), b.module.parameters(), strict=True):
            assert torch.allclose(p, q, atol=1e-5, rtol=1e-4), name
        assert b.loss_curve == pytest.approx(a.loss_curve, rel=1e-4)
        assert (b.loss_start, b.loss_end, b.rho_l1) == pytest.approx(
            (a.loss_start, a.loss_end, a.rho_l1), rel=1e-4
        )
