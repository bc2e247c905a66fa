"""Held-out measurement and selection: which correction helps this merge, on the user's own data.

A seeded fraction of the calibration prompts is held out from training (or, cross-fitting,
each of a seeded split into folds in turn). On it, for the merged
model before and after its module, three numbers say how close the merge comes to its target:
top-1 agreement with the target's next token, KL(target || merge) of the next-token
distributions (both through each model's real output path, :mod:`.head`), and rho_L1 of the
hidden states. ``select:`` trains every candidate setting on the same captures and keeps the best
by one of them. Everything runs batch by batch in float32; an N x T x V tensor never exists.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.calibrate.train import positions_of
from mergekit_darts.config import holdout_count
from mergekit_darts.correction.darts_correction import SurgeryModule
from mergekit_darts.correction.head import logit_chunks
from mergekit_darts.correction.metrics import delta, rho_from_sums, token_kl

METRIC_BEST = {"agreement": max, "kl": min, "rho_l1": max}  # how each selection metric ranks
ROWS_PER_STEP = 8  # sequences per held-out evaluation step


def holdout_split(n: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(training rows, held-out rows) of ``n`` sequences, both sorted; ``seed`` fixes the draw."""
    held = holdout_count(fraction, n)
    if held >= n and held:
        raise ValueError(f"holding out {held} of {n} prompts leaves none to train on")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return order[held:].sort().values, order[:held].sort().values


@dataclass(frozen=True)
class HeldOut:
    """Before / after metrics of one module over the counted tokens of the held-out rows."""

    tokens: int
    rho_l1: float | None
    agreement_before: float | None = None  # None: no verified heads, or different vocabularies
    agreement_after: float | None = None
    kl_before: float | None = None
    kl_after: float | None = None

    def summary(self) -> dict[str, float | None]:
        """The three selection metrics, after the module."""
        return {"agreement": self.agreement_after, "kl": self.kl_after, "rho_l1": self.rho_l1}

    def as_dict(self) -> dict[str, float | int | None]:
        return dict(vars(self))


def logits_comparable(merged: Captured, target: Captured) -> bool:
    """Agreement and KL need both real output paths, checked, over one vocabulary."""
    heads = (merged.head, target.head)
    if any(h is None or not h.verified for h in heads):
        return False
    return merged.head.vocab_size == target.head.vocab_size


def fold_split(n: int, folds: int, seed: int) -> list[torch.Tensor]:
    """``folds`` disjoint sorted row sets covering ``n`` sequences, their sizes differing by one
    at most (cross-fitting); ``seed`` fixes the draw, as in :func:`holdout_split`."""
    if not 2 <= folds <= n:
        raise ValueError(f"{folds} folds of {n} prompts: need 2 <= folds <= prompts")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return [part.sort().values for part in torch.tensor_split(order, folds)]


def cross_fit_splits(n: int, folds: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(training rows, judged rows) per fold of :func:`fold_split`: each fold is judged by the
    module trained on every other row."""
    every = torch.arange(n)
    return [(every[~torch.isin(every, fold)], fold) for fold in fold_split(n, folds, seed)]


def held_out_metrics(
    module: SurgeryModule, merged: Captured, target: Captured, counted: torch.Tensor
) -> HeldOut:
    """Agreement, KL and rho_L1 before / after ``module`` over the ``counted`` [N, T] tokens."""
    return cross_fitted_metrics([([module], counted)], merged, target)[0]


@torch.no_grad()
def cross_fitted_metrics(
    folds: Sequence[tuple[Sequence[SurgeryModule], torch.Tensor]],
    merged: Captured,
    target: Captured,
) -> list[HeldOut]:
    """:func:`held_out_metrics` of several candidates, pooled over ``(modules, counted)`` folds:
    each fold's module of each candidate on the tokens it did not train on; the sums are pooled,
    so every token weighs the same. The target's logits and the merge's own are computed once
    per token for every candidate (a ``none`` module is the merge itself): the LM head, the
    costly part, runs 2 + corrections times per token, not 3 x candidates."""
    with_logits = logits_comparable(merged, target)
    count = len(folds[0][0])
    sums = torch.zeros(count, 6, dtype=torch.float64)  # per candidate: agree b/a, kl b/a, delta b/a
    tokens = 0
    device = merged.hidden.device
    for modules, counted in folds:
        modules = [module.eval() for module in modules]
        counted = counted.to(device=device, dtype=torch.bool)
        for start in range(0, counted.shape[0], ROWS_PER_STEP):
            rows = slice(start, start + ROWS_PER_STEP)
            keep = counted[rows]
            if not keep.any():
                continue
            h = merged.hidden[rows][keep].to(torch.float32)  # [P, H]
            h_star = target.hidden[rows][keep].to(torch.float32)
            positions = positions_of(merged.mask[rows])[keep]
            corrected = [None if m.kind == "none" else m(h, positions) for m in modules]
            tokens += h.shape[0]
            before = delta(h, h_star).sum().double()
            sums[:, 4] += before
            for i, h_hat in enumerate(corrected):
                sums[i, 5] += before if h_hat is None else delta(h_hat, h_star).sum().double()
            if with_logits:
                for part in logit_chunks(h.shape[0]):
                    target_logits = target.head.logits(h_star[part])
                    best = target_logits.argmax(-1)
                    own = _agreement_kl(merged.head.logits(h[part]), best, target_logits)
                    sums[:, 0] += own[0]
                    sums[:, 2] += own[1]
                    for i, h_hat in enumerate(corrected):
                        after = own
                        if h_hat is not None:
                            after = _agreement_kl(
                                merged.head.logits(h_hat[part]), best, target_logits
                            )
                        sums[i, 1] += after[0]
                        sums[i, 3] += after[1]
    if tokens == 0:
        raise ValueError("no held-out token to measure on")
    return [_held_out(tokens, row, with_logits) for row in sums]


def _agreement_kl(
    logits: torch.Tensor, best: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-1 agreements with ``best``, summed KL(target || logits)) of one chunk, float64."""
    agree = (logits.argmax(-1) == best).sum().double()
    return agree, token_kl(target_logits, logits).sum().double()


def _held_out(tokens: int, sums: torch.Tensor, with_logits: bool) -> HeldOut:
    """One candidate's :class:`HeldOut` from its pooled sums (agree b/a, kl b/a, delta b/a)."""
    rho = rho_from_sums(sums[4], sums[5])
    if not with_logits:
        return HeldOut(tokens, rho)
    agree, kl = (sums[:2] / tokens).tolist(), (sums[2:4] / tokens).tolist()
    return HeldOut(tokens, rho, agree[0], agree[1], kl[0], kl[1])


def choose(scores: Sequence[float | None], metric: str) -> int:
    """Index of the best candidate by ``metric``; the first wins a tie, a missing score never."""
    usable = [(s, i) for i, s in enumerate(scores) if s is not None and not math.isnan(s)]
    if not usable:
        raise ValueError(f"no candidate has a held-out {metric}")
    best = METRIC_BEST[metric](s for s, _ in usable)
    return next(i for s, i in usable if s == best)


def candidate_label(candidate: Mapping[str, Any], others: list[Mapping[str, Any]]) -> str:
    """``module + loss``, plus whichever other settings differ between the candidates."""
    varying = [
        key
        for key in ("rank", "max_positions", "steps", "lr", "batch_size", "seed", "loss_positions")
        if len({str(c[key]) for c in others}) > 1
    ]
    extra = "".join(f", {key} {candidate[key]}" for key in varying)
    if candidate["module"] == "none":
        return "none (the merge as it is)"
    return f"{candidate['module']} + {candidate['loss']}{extra}"
