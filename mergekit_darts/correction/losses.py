"""Training objectives of the surgery module (paper eq. 5 and 6, appendix D).

All take hidden states or logits [B, T, ...] and a mask [B, T] (1 = token that counts) and
average over the counted tokens only, so padding never changes the loss.
"""

from __future__ import annotations

import torch

from mergekit_darts.correction.metrics import token_kl

LOSSES = ("l1", "ewl1", "kl", "ce")
LOGIT_LOSSES = ("kl", "ce")  # losses that need both models' next-token distributions


def _counted(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = mask.to(torch.float32)
    count = keep.sum()
    if count == 0:
        raise ValueError("the loss mask selects no tokens")
    return keep, count


def _token_l1(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (pred.to(torch.float32) - target.to(torch.float32)).abs().mean(-1)


def l1(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(1 / (H |T|)) sum_t ||pred_t - target_t||_1``."""
    keep, count = _counted(mask)
    return (_token_l1(pred, target) * keep).sum() / count


def ewl1(
    pred: torch.Tensor, target: torch.Tensor, entropy: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """L1 weighted per token by the target's entropy over its mean on the counted tokens.

    The unit-mean weights keep the loss on the scale of ``l1`` so the same learning rate works.
    """
    keep, count = _counted(mask)
    entropy = entropy.to(torch.float32) * keep
    mean_entropy = entropy.sum() / count
    if mean_entropy <= 0:
        return l1(pred, target, mask)  # a target certain everywhere gives no weighting signal
    return (_token_l1(pred, target) * entropy / mean_entropy).sum() / count


def kl(pred_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over counted tokens of ``KL(softmax(target) || softmax(pred))``."""
    keep, count = _counted(mask)
    return (token_kl(target_logits, pred_logits) * keep).sum() / count


def ce(pred_logits: torch.Tensor, target_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over counted tokens of the cross-entropy of ``pred`` against ``argmax(target)``."""
    keep, count = _counted(mask)
    log_q = torch.log_softmax(pred_logits.to(torch.float32), -1)
    labels = target_logits.argmax(-1, keepdim=True)
    per_token = -log_q.gather(-1, labels).squeeze(-1)
    return (per_token * keep).sum() / count
