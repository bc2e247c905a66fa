"""Losses and metrics against independent float64 references written here."""

from __future__ import annotations

import math

import pytest
import torch

from mergekit_darts.correction import losses, metrics


def _data(seed: int = 0, b: int = 3, t: int = 5, h: int = 7, v: int = 11):
    g = torch.Generator().manual_seed(seed)
    pred = torch.randn(b, t, h, generator=g)
    target = torch.randn(b, t, h, generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    entropy = torch.rand(b, t, generator=g) * 3
    logits_p = torch.randn(b, t, v, generator=g) * 2
    logits_q = torch.randn(b, t, v, generator=g) * 2
    return pred, target, mask, entropy, logits_p, logits_q


def _real_tokens(mask):
    return [(i, j) for i in range(mask.shape[0]) for j in range(mask.shape[1]) if mask[i, j]]


def _ref_l1(pred, target, mask, weights=None):
    total, tokens = 0.0, _real_tokens(mask)
    for i, j in tokens:
        w = 1.0 if weights is None else weights[(i, j)]
        total += w * sum(
            abs(float(a) - float(b)) for a, b in zip(pred[i, j], target[i, j], strict=True)
        )
    return total / (pred.shape[-1] * len(tokens))


def _ref_softmax(row):
    m = max(float(x) for x in row)
    exps = [math.exp(float(x) - m) for x in row]
    s = sum(exps)
    return [e / s for e in exps]


def test_l1_matches_reference():
    pred, target, mask, *_ = _data()
    assert losses.l1(pred, target, mask).item() == pytest.approx(
        _ref_l1(pred, target, mask), rel=1e-6
    )


def test_l1_ignores_padding_values():
    pred, target, mask, *_ = _data()
    changed = pred.clone()
    changed[~mask.bool()] = 1e6
    assert losses.l1(changed, target, mask).item() == pytest.approx(
        losses.l1(pred, target, mask).item()
    )


def test_ewl1_matches_reference():
    pred, target, mask, entropy, *_ = _data(1)
    tokens = _real_tokens(mask)
    mean_h = sum(float(entropy[i, j]) for i, j in tokens) / len(tokens)
    weights = {(i, j): float(entropy[i, j]) / mean_h for i, j in tokens}
    expected = _ref_l1(pred, target, mask, weights)
    got = losses.ewl1(pred, target, entropy, mask).item()
    assert got == pytest.approx(expected, rel=1e-6)
    # unit-mean weights: constant entropy gives exactly l1
    flat = torch.full_like(entropy, 0.7)
    assert losses.ewl1(pred, target, flat, mask).item() == pytest.approx(
        losses.l1(pred, target, mask).item(), rel=1e-6
    )


def test_token_entropy_matches_reference():
    *_, logits, _ = _data(2)
    got = metrics.token_entropy(logits)
    for i in range(logits.shape[0]):
        for j in range(logits.shape[1]):
            p = _ref_softmax(logits[i, j])
            assert float(got[i, j]) == pytest.approx(-sum(x * math.log(x) for x in p), rel=1e-5)


def test_token_entropy_is_float32_for_half_inputs():
    *_, logits, _ = _data(2)
    got = metrics.token_entropy(logits.to(torch.bfloat16))
    assert got.dtype == torch.float32


def test_kl_and_ce_match_reference():
    _, _, mask, _, target_logits, pred_logits = _data(3)
    tokens = _real_tokens(mask)
    kl_total = ce_total = 0.0
    for i, j in tokens:
        p, q = _ref_softmax(target_logits[i, j]), _ref_softmax(pred_logits[i, j])
        kl_total += sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q, strict=True))
        ce_total += -math.log(q[max(range(len(p)), key=p.__getitem__)])
    assert losses.kl(pred_logits, target_logits, mask).item() == pytest.approx(
        kl_total / len(tokens), rel=1e-5
    )
    assert losses.ce(pred_logits, target_logits, mask).item() == pytest.approx(
        ce_total / len(tokens), rel=1e-5
    )


def test_delta_and_rho_l1_match_reference():
    h_m, h_t, mask, *_ = _data(4)
    h_hat = (
        h_m
        + 0.5 * (h_t - h_m)
        + 0.01 * torch.randn(h_m.shape, generator=torch.Generator().manual_seed(9))
    )
    tokens = _real_tokens(mask)

    def ref_delta(a, b, i, j):
        return (
            sum(abs(float(x) - float(y)) for x, y in zip(a[i, j], b[i, j], strict=True))
            / a.shape[-1]
        )

    before = sum(ref_delta(h_m, h_t, i, j) for i, j in tokens)
    after = sum(ref_delta(h_hat, h_t, i, j) for i, j in tokens)
    assert metrics.rho_l1(h_m, h_hat, h_t, mask) == pytest.approx(1 - after / before, rel=1e-6)
    d = metrics.delta(h_m, h_t)
    assert d.shape == mask.shape
    assert float(d[1, 2]) == pytest.approx(ref_delta(h_m, h_t, 1, 2), rel=1e-6)


def test_empty_mask_is_an_error():
    pred, target, mask, entropy, *_ = _data()
    with pytest.raises(ValueError, match="selects no tokens"):
        losses.l1(pred, target, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="identical"):
        metrics.rho_l1(pred, pred, pred, mask)


def test_rho_from_deltas_matches_reference_for_torch_and_numpy():
    before = torch.tensor([[0.5, 1.0, 2.0], [1.5, 0.0, 0.0]])
    after = torch.tensor([[0.25, 0.5, 9.0], [0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    expected = 1 - (0.25 + 0.5 + 0.5) / (0.5 + 1.0 + 1.5)
    assert metrics.rho_from_deltas(before, after, mask) == pytest.approx(expected)
    assert metrics.rho_from_deltas(before.numpy(), after.numpy(), mask.numpy()) == pytest.approx(
        expected
    )
    assert metrics.rho_from_deltas(before * 0, after, mask) is None


def test_rho_from_sums_is_eq_7_on_totals():
    from mergekit_darts.correction.metrics import rho_from_sums

    before = torch.tensor(3.0, dtype=torch.float64)
    assert rho_from_sums(before, torch.tensor(1.25, dtype=torch.float64)) == 1 - 1.25 / 3.0
    assert rho_from_sums(0.0, 1.0) is None


def test_masked_minus_inf_logits_are_probability_zero_not_nan():
    """Entropy and KL with -inf logits against a float64 sum over the finite tokens only."""
    from mergekit_darts.correction.metrics import token_entropy, token_kl

    logits = torch.tensor([[1.0, -math.inf, 0.5, 2.0], [0.0, 0.0, -math.inf, -math.inf]])
    pred = torch.tensor([[0.5, 0.1, -1.0, 1.0], [1.0, -math.inf, 0.0, 0.3]])
    for row in range(2):
        finite = [x for x in logits[row].tolist() if x != -math.inf]
        z = math.log(sum(math.exp(x) for x in finite))
        expected = -sum(math.exp(x - z) * (x - z) for x in finite)
        assert token_entropy(logits)[row].item() == pytest.approx(expected, abs=1e-6)
    kl = token_kl(logits, pred)
    p = [
        math.exp(x - math.log(sum(math.exp(y) for y in logits[0].tolist())))
        for x in logits[0].tolist()
    ]
    zq = math.log(sum(math.exp(y) for y in pred[0].tolist()))
    expected = sum(
        pi * (math.log(pi) - (q - zq)) for pi, q in zip(p, pred[0].tolist(), strict=True) if pi > 0
    )
    assert kl[0].item() == pytest.approx(expected, abs=1e-6)
    assert kl[1].item() == math.inf  # the target allows token 1, the prediction rules it out
