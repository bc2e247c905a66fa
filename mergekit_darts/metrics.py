"""Measurements of representation bias (paper eq. 2 and 7) and of the target's uncertainty."""

from __future__ import annotations

import torch


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (natural log) of ``softmax(logits)`` over the last axis, computed in float32."""
    log_p = torch.log_softmax(logits.to(torch.float32), dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def delta(h_a: torch.Tensor, h_b: torch.Tensor) -> torch.Tensor:
    """Per-token bias ``delta_t = ||h_a - h_b||_1 / H``: [B, T, H] -> [B, T], float32."""
    return (h_a.to(torch.float32) - h_b.to(torch.float32)).abs().mean(-1)


def rho_l1(
    h_merged: torch.Tensor, h_hat: torch.Tensor, h_target: torch.Tensor, mask: torch.Tensor
) -> float:
    """``1 - sum delta_after / sum delta_before`` over the real tokens (mask 1); higher is better."""
    keep = mask.to(torch.bool)
    before = delta(h_merged, h_target)[keep].sum()
    after = delta(h_hat, h_target)[keep].sum()
    if before == 0:
        raise ValueError("rho_l1 is undefined: the merged and target hidden states are identical")
    return float(1 - after / before)
