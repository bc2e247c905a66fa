"""Closed-form fits of the plain kinds: one pass over the captured states, no optimizer.

``head`` (``h_hat = A h``, ``A = I - M``) is a ridge regression of the target's final states on
the merge's, shrunk towards the identity:

    A = (sum_t w_t h*_t h_t^T + lam I) (sum_t w_t h_t h_t^T + lam I)^-1

and ``norm`` (``h_hat = s * h``) the same per channel. The sample weights ``w_t`` are DARTS's
entropy weights under ``ewl1`` (``H_t / mean H``) and 1 under ``l1``; ``lam`` is
:data:`RIDGE` times the mean diagonal of the weighted Gram matrix, so it scales with the states.
A squared loss in place of the L1 one is what makes the fit one solve: at H = 4096 a full H x H
map trained by Adam would cost 500 steps of 16M-parameter products, the solve costs one pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.correction.darts_correction import HeadSurgery, NormSurgery, SurgeryModule

RIDGE = 1e-3  # shrinkage towards the identity, relative to the states' mean square
BATCH_ROWS = 8  # sequences per accumulation step (the [rows, T, H] float64 slice)


def closed_form(module: SurgeryModule) -> bool:
    """Whether ``module``'s kind has a closed-form fit here."""
    return isinstance(module, HeadSurgery | NormSurgery)


def sample_weights(target: Captured, counted: torch.Tensor, loss: str) -> torch.Tensor:
    """[N, T] float64: each counted token's weight in the fit (zero elsewhere)."""
    keep = counted.to(torch.float64)
    if loss != "ewl1":
        return keep
    entropy = target.entropy.to(torch.float64) * keep
    return entropy / (entropy.sum() / keep.sum())


@dataclass
class PlainStatistics:
    """The weighted sums a plain fit solves from: ``gram`` = sum w h h^T (per channel for
    ``norm``: sum w h^2) and ``cross`` = sum w h* h^T. Sums of several tasks' statistics fit
    one correction for all of them (the joint correction, ``calibrate.joint``)."""

    gram: torch.Tensor
    cross: torch.Tensor

    def __add__(self, other: PlainStatistics) -> PlainStatistics:
        return PlainStatistics(self.gram + other.gram, self.cross + other.cross)


@torch.no_grad()
def plain_statistics(
    module: SurgeryModule, merged: Captured, target: Captured, counted: torch.Tensor, loss: str
) -> PlainStatistics:
    """``module``'s kind's statistics over the ``counted`` tokens [N, T], in float64."""
    weights = sample_weights(target, counted, loss)
    hidden = merged.hidden.shape[-1]
    per_channel = isinstance(module, NormSurgery)
    shape = (hidden,) if per_channel else (hidden, hidden)
    gram = torch.zeros(shape, dtype=torch.float64, device=merged.hidden.device)
    cross = torch.zeros_like(gram)
    for rows in torch.arange(merged.hidden.shape[0]).split(BATCH_ROWS):
        w = weights[rows].reshape(-1, 1).to(gram.device)
        h = merged.hidden[rows].reshape(-1, hidden).to(torch.float64)
        h_star = target.hidden[rows].reshape(-1, hidden).to(torch.float64)
        if per_channel:
            gram += (w * h * h).sum(0)
            cross += (w * h_star * h).sum(0)
        else:
            gram += (w * h).T @ h
            cross += (w * h_star).T @ h
    return PlainStatistics(gram, cross)


@torch.no_grad()
def solve(module: SurgeryModule, stats: PlainStatistics) -> None:
    """Set ``module``'s tensors to the ridge solution of ``stats``."""
    gram, cross = stats.gram, stats.cross
    per_channel = isinstance(module, NormSurgery)
    diagonal = gram if per_channel else gram.diagonal()
    lam = RIDGE * float(diagonal.mean())
    if per_channel:
        scale = (cross + lam) / (gram + lam)
        module.shift.copy_((1.0 - scale).to(module.shift.dtype))
        return
    eye = torch.eye(gram.shape[0], dtype=torch.float64, device=gram.device)
    # A (G + lam I) = C + lam I, solved as (G + lam I) A^T = (C + lam I)^T (G is symmetric)
    a = torch.linalg.solve(gram + lam * eye, (cross + lam * eye).T).T
    module.weight.copy_((eye - a).to(module.weight.device, module.weight.dtype))


def fit_closed_form(
    module: SurgeryModule, merged: Captured, target: Captured, counted: torch.Tensor, loss: str
) -> None:
    """Set ``module``'s tensors to the ridge solution on the ``counted`` tokens [N, T]."""
    solve(module, plain_statistics(module, merged, target, counted, loss))
