"""Measurements of representation bias (paper eq. 2 and 7) and of the target's uncertainty."""

from __future__ import annotations

from typing import Any

import torch


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (natural log) of ``softmax(logits)`` over the last axis, computed in float32.

    A ``-inf`` logit (a masked token: some heads set them) is a token of probability 0 and adds
    nothing (0 log 0 = 0), instead of the NaN of ``0 * -inf``.
    """
    log_p = torch.log_softmax(logits.to(torch.float32), dim=-1)
    p = log_p.exp()
    return -torch.where(p > 0, p * log_p, 0.0).sum(-1)


def token_kl(target_logits: torch.Tensor, pred_logits: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(target) || softmax(pred))`` per position over the last axis, in float32.

    Tokens the target gives probability 0 (``-inf`` logits) add nothing; a token the target
    allows and the prediction rules out makes it ``inf``, as it should.
    """
    log_p = torch.log_softmax(target_logits.to(torch.float32), -1)
    log_q = torch.log_softmax(pred_logits.to(torch.float32), -1)
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)


def delta(h_a: torch.Tensor, h_b: torch.Tensor) -> torch.Tensor:
    """Per-token bias ``delta_t = ||h_a - h_b||_1 / H``: [B, T, H] -> [B, T], float32."""
    return (h_a.to(torch.float32) - h_b.to(torch.float32)).abs().mean(-1)


def rho_l1(
    h_merged: torch.Tensor, h_hat: torch.Tensor, h_target: torch.Tensor, mask: torch.Tensor
) -> float:
    """``1 - sum delta_after / sum delta_before`` over the real tokens (mask 1); higher is better."""
    keep = mask.to(torch.bool)
    rho = rho_from_deltas(delta(h_merged, h_target), delta(h_hat, h_target), keep)
    if rho is None:
        raise ValueError("rho_l1 is undefined: the merged and target hidden states are identical")
    return rho


def rho_from_deltas(before: Any, after: Any, mask: Any) -> float | None:
    """rho_L1 from stored per-token deltas (torch or numpy, [N, T]); None when nothing to remove."""
    return rho_from_sums(before[mask].sum(), after[mask].sum())


def rho_from_sums(before: Any, after: Any) -> float | None:
    """rho_L1 from the sums of delta before and after over the counted tokens (eq. 7); None when
    nothing was there to remove."""
    return None if before == 0 else float(1 - after / before)
