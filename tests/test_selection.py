"""Held-out split and metrics against float64 references written here, and the choice rule."""

from __future__ import annotations

import pytest
import torch

from mergekit_darts import build_module
from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.calibrate.selection import (
    choose,
    cross_fitted_metrics,
    held_out_metrics,
    holdout_split,
)
from mergekit_darts.correction.head import OutputHead

N, T, H, V = 11, 9, 6, 13


def _captured(seed: int, lengths: list[int], bias: bool) -> Captured:
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    hidden = torch.randn(N, T, H, generator=g) * mask.unsqueeze(-1)
    head = OutputHead(
        weight=torch.randn(V, H, generator=g),
        bias=torch.randn(V, generator=g) if bias else None,
        scale=0.5,
        softcap=3.0,
        model_class="Tiny",
        verified=True,
    )
    return Captured(hidden=hidden, mask=mask, head=head)


def _logits64(head: OutputHead, h: torch.Tensor) -> torch.Tensor:
    x = h.double() @ head.weight.double().T
    if head.bias is not None:
        x = x + head.bias.double()
    x = x * head.scale
    return head.softcap * torch.tanh(x / head.softcap)


def _reference(module, merged: Captured, target: Captured, counted: torch.Tensor) -> dict:
    """Token by token in float64: agreement, KL(target || merge), rho_L1, before and after."""
    return _ratios(*_totals(module, merged, target, counted))


def _totals(module, merged: Captured, target: Captured, counted: torch.Tensor) -> tuple[dict, int]:
    """The float64 sums behind :func:`_reference`, and the tokens counted."""
    totals = dict.fromkeys(("agree_b", "agree_a", "kl_b", "kl_a", "d_b", "d_a"), 0.0)
    tokens = 0
    for i in range(N):
        position = -1
        for t in range(T):
            if not merged.mask[i, t]:
                continue
            position += 1
            if not counted[i, t]:
                continue
            tokens += 1
            h, h_star = merged.hidden[i, t].double(), target.hidden[i, t].double()
            with torch.no_grad():
                h_hat = module(merged.hidden[i, t][None].float(), torch.tensor([position]))[0]
            p = torch.softmax(_logits64(target.head, h_star), -1)
            for tag, x in (("b", h), ("a", h_hat.double())):
                q = torch.softmax(_logits64(merged.head, x), -1)
                totals[f"agree_{tag}"] += float(q.argmax() == p.argmax())
                totals[f"kl_{tag}"] += float((p * (p.log() - q.log())).sum())
                totals[f"d_{tag}"] += float((x - h_star).abs().mean())
    return totals, tokens


def _ratios(totals: dict, tokens: int) -> dict:
    return {
        "tokens": tokens,
        "agreement_before": totals["agree_b"] / tokens,
        "agreement_after": totals["agree_a"] / tokens,
        "kl_before": totals["kl_b"] / tokens,
        "kl_after": totals["kl_a"] / tokens,
        "rho_l1": 1 - totals["d_a"] / totals["d_b"],
    }


@pytest.fixture(scope="module")
def pair():
    lengths = [9, 3, 7, 1, 9, 5, 8, 2, 6, 9, 4]
    merged, target = _captured(0, lengths, bias=True), _captured(1, lengths, bias=True)
    module = build_module("pos_corr", H, rank=3, max_positions=6, seed=0)
    with torch.no_grad():  # a non-trivial module: the fresh one is the identity
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.3)
    return merged, target, module


def test_held_out_metrics_match_a_float64_reference(pair):
    merged, target, module = pair
    counted = merged.mask.clone()
    counted[::3] = False  # some rows not counted at all
    counted[1, 0] = False  # and a single token
    got = held_out_metrics(module, merged, target, counted)
    want = _reference(module, merged, target, counted)
    assert got.tokens == want["tokens"]
    for key in ("agreement_before", "agreement_after", "kl_before", "kl_after", "rho_l1"):
        assert getattr(got, key) == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert got.summary() == {
        "agreement": got.agreement_after,
        "kl": got.kl_after,
        "rho_l1": got.rho_l1,
    }


def test_candidates_measured_together_pool_each_ones_folds(pair):
    """Several candidates in one pass (sharing the head passes of the merge and the target) give
    each candidate's own numbers: its fold modules on their folds' tokens, pooled; ``none`` is
    the merge itself."""
    merged, target, module = pair
    other = build_module("standard", H, rank=2, max_positions=6, seed=1)
    with torch.no_grad():
        for p in other.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    none = build_module("none", H)
    first = merged.mask.clone()
    first[6:] = False
    second = merged.mask & ~first
    second[8, 1] = False  # a token no fold counts
    folds = [([module, none, other], first), ([other, none, module], second)]
    got = cross_fitted_metrics(folds, merged, target)
    for i, measured in enumerate(got):
        parts = [_totals(modules[i], merged, target, counted) for modules, counted in folds]
        totals = {key: sum(t[key] for t, _ in parts) for key in parts[0][0]}
        want = _ratios(totals, sum(tokens for _, tokens in parts))
        assert measured.tokens == want["tokens"]
        for key in ("agreement_before", "agreement_after", "kl_before", "kl_after", "rho_l1"):
            assert getattr(measured, key) == pytest.approx(want[key], rel=1e-5, abs=1e-6), (i, key)
    assert got[1].rho_l1 == 0.0 and got[1].kl_after == got[1].kl_before
    assert got[0].kl_after != got[1].kl_after


def test_logit_metrics_are_none_without_a_checked_head_or_with_other_vocabularies(pair):
    merged, target, module = pair
    unchecked = Captured(merged.hidden, merged.mask, head=OutputHead(merged.head.weight))
    other_vocab = Captured(
        target.hidden,
        target.mask,
        head=OutputHead(torch.randn(V + 2, H), verified=True),
    )
    for m, t in ((unchecked, target), (merged, other_vocab)):
        got = held_out_metrics(module, m, t, merged.mask)
        assert got.agreement_after is None and got.kl_before is None and got.rho_l1 is not None


def test_holdout_split_is_seeded_disjoint_and_sized():
    train, held = holdout_split(50, 0.2, seed=0)
    assert len(held) == 10 and len(train) == 40
    assert sorted(train.tolist() + held.tolist()) == list(range(50))
    assert torch.equal(held, holdout_split(50, 0.2, seed=0)[1])
    assert not torch.equal(held, holdout_split(50, 0.2, seed=1)[1])
    assert len(holdout_split(3, 0.1, seed=0)[1]) == 1  # at least one prompt
    with pytest.raises(ValueError, match="leaves none to train on"):
        holdout_split(1, 0.5, seed=0)


def test_choose_follows_each_metrics_direction():
    assert choose([0.5, 0.7, 0.7], "agreement") == 1  # first of a tie
    assert choose([0.5, 0.2, 0.3], "kl") == 1
    assert choose([None, 0.1, float("nan")], "rho_l1") == 1
    with pytest.raises(ValueError, match="no candidate has a held-out kl"):
        choose([None, None], "kl")
