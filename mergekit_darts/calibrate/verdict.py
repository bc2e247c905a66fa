"""The held-out verdict: keep a correction only where it beats the merge as it is, where it counts.

A task's score is decided by what the model generates after a prompt, so the verdict is measured
there: each held-out calibration prompt is completed greedily by the target, and each candidate
(``{module: none}``, the merge as it is, always among them) is teacher-forced on prompt +
completion. At the positions that predict the completion (the last prompt token through the last
completion token, whose next token is the end of the sequence when the target stopped before
``completion_tokens``) three numbers per prompt say how close the corrected merge comes:

- ``completion_match``: 1 when its top-1 token is the target's next token at every such position
  (at the end: one of the merged model's end-of-sequence ids), else 0. Greedy decoding emits the
  top-1 token, so this is exactly "its greedy completion equals the target's" (up to the rounding
  of the cached hidden states): exact match against the expert. It needs the merged model's LM
  head only, so a target with appended tokens (``target_vocab: prefix``) is measured too.
- ``completion_agreement``: the share of those positions where the top-1 tokens agree.
- ``completion_rho_l1``: rho_L1 of the hidden states over those positions.

A candidate is kept only when a one-sided exact sign test over the held-out prompts (how many
prompts it scores above ``none`` against below it; ties carry no information) rejects "no better
than none" at ``alpha`` divided by the number of corrections tried (Bonferroni). So under the null
that no correction beats the merge, a correction is kept with probability at most ``alpha``, and
with few held-out prompts none can pass (10 prompts need 9 better and 1 worse at most for
``alpha = 0.05`` and one correction) and the merge stays as it is. Among corrections that pass,
the best mean wins.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.calibrate.train import positions_of
from mergekit_darts.core.metrics import delta, rho_from_sums
from mergekit_darts.core.modules import SurgeryModule

NAMES = {
    "completion_match": "completion match",
    "completion_agreement": "completion agreement",
    "completion_rho_l1": "completion ρ_L1",
}
END_OF_COMPLETION = -1  # the reference at a position that predicts the end of the completion


@dataclass(frozen=True)
class HeldOutCompletions:
    """The held-out prompts completed by the target, captured on both models."""

    merged: Captured
    target: Captured
    reference: (
        torch.Tensor
    )  # [N, T] long: the next token at a predicting position (or END_OF_COMPLETION)
    predicting: torch.Tensor  # [N, T] bool: the positions that predict the completion
    eos_ids: frozenset[int]  # the merged model's end-of-sequence ids


def completion_reference(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], max_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(reference, predicting) [N, T] of right-padded prompt + completion rows.

    Position ``p - 1 + j`` predicts completion token ``j``; a completion shorter than
    ``max_tokens`` ended with an end-of-sequence token, which position ``p - 1 + c`` predicts
    (its reference is :data:`END_OF_COMPLETION`: any end-of-sequence id ends the merge's completion too).
    """
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    reference = torch.full((len(prompts), width), END_OF_COMPLETION, dtype=torch.long)
    predicting = torch.zeros((len(prompts), width), dtype=torch.bool)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        start, count = len(prompt) - 1, len(completion)
        reference[row, start : start + count] = torch.as_tensor(list(completion), dtype=torch.long)
        ended = count < max_tokens
        predicting[row, start : start + count + ended] = True
    return reference, predicting


@torch.no_grad()
def completion_scores(
    module: SurgeryModule, held: HeldOutCompletions
) -> dict[str, list[float | None]]:
    """Per held-out prompt: completion match and agreement (None without a verified merged LM
    head) and rho_L1 (None where the merge already equals the target) of ``module``."""
    head = held.merged.head
    with_logits = head is not None and bool(head.verified)
    module = module.eval()
    device = held.merged.hidden.device
    eos = torch.tensor(sorted(held.eos_ids), dtype=torch.long, device=device)
    scores: dict[str, list[float | None]] = {name: [] for name in NAMES}
    for row in range(held.predicting.shape[0]):
        keep = held.predicting[row].to(device)
        h = held.merged.hidden[row][keep].to(torch.float32)  # [P, H]
        h_star = held.target.hidden[row][keep].to(torch.float32)
        h_hat = module(h, positions_of(held.merged.mask[row : row + 1])[0][keep])
        before, after = delta(h, h_star).double().sum(), delta(h_hat, h_star).double().sum()
        scores["completion_rho_l1"].append(rho_from_sums(before, after))
        if not with_logits:
            scores["completion_match"].append(None)
            scores["completion_agreement"].append(None)
            continue
        wanted = held.reference[row].to(device)[keep]
        top1 = head.top1(h_hat).to(device)
        agree = int(
            torch.where(wanted == END_OF_COMPLETION, torch.isin(top1, eos), top1 == wanted).sum()
        )
        scores["completion_agreement"].append(agree / h.shape[0])
        scores["completion_match"].append(float(agree == h.shape[0]))
    return scores


def sign_test(candidate: Sequence[float | None], none: Sequence[float | None]) -> dict[str, Any]:
    """One-sided exact sign test of "``candidate`` scores above ``none``" over paired prompts.

    ``better``/``worse``: prompts where the candidate scores above / below; ties and missing
    values are dropped. ``p`` = P(Binomial(better + worse, 1/2) >= better); 1 with no pair left.
    """
    pairs = [
        (a, b) for a, b in zip(candidate, none, strict=True) if a is not None and b is not None
    ]
    better = sum(a > b for a, b in pairs)
    worse = sum(a < b for a, b in pairs)
    n = better + worse
    p = sum(math.comb(n, k) for k in range(better, n + 1)) / 2**n if n else 1.0
    return {"better": better, "worse": worse, "prompts": len(pairs), "p": p}


def mean(values: Sequence[float | None]) -> float | None:
    """Mean of the values that exist; None if none does."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def decide(
    entries: list[dict[str, Any]], labels: Sequence[str], metric: str, alpha: float
) -> tuple[int, str]:
    """(index of the kept candidate, the verdict in one line) from the candidates' manifest
    entries (each with ``verdict`` per-prompt scores, or ``diverged``); records each test.

    ``none`` is kept unless a correction's sign test against it passes at ``alpha`` / the
    number of corrections measured; among those that pass, the best mean of ``metric`` wins
    (the first on a tie).
    """
    none = next(i for i, e in enumerate(entries) if e["module"] == "none")
    baseline = entries[none]["verdict"][metric]
    tried = [
        i
        for i, e in enumerate(entries)
        if i != none and "diverged" not in e and e["module"] != "none"
    ]
    name = NAMES[metric]
    base_mean = mean(baseline)
    if not tried:
        corrections = any(e["module"] != "none" for e in entries)
        why = (
            "every correction's training diverged" if corrections else "none was the only candidate"
        )
        return none, f"kept no correction: {why}"
    level = alpha / len(tried)
    for i in tried:
        entries[i]["test"] = {**sign_test(entries[i]["verdict"][metric], baseline), "level": level}
    passing = [i for i in tried if entries[i]["test"]["p"] <= level]
    best = max(passing or tried, key=lambda i: _rank(entries[i]["held_out"][metric]))
    test, score = entries[best]["test"], entries[best]["held_out"][metric]
    counts = (
        f"better on {test['better']}, worse on {test['worse']} of {test['prompts']} prompts, "
        f"sign test p = {test['p']:.3g}"
    )
    if passing:
        return best, (
            f"kept {labels[best]}: held-out {name} {_fmt(score)}, none {_fmt(base_mean)} "
            f"({counts} <= {level:.3g})"
        )
    below = all(_rank(entries[i]["held_out"][metric]) < _rank(base_mean) for i in tried)
    why = (
        "every candidate scored below the merge"
        if below
        else "no candidate beat the merge by the sign test"
    )
    return none, (
        f"kept no correction: {why} on held-out completions (best {labels[best]}: {name} "
        f"{_fmt(score)}, none {_fmt(base_mean)}; {counts} > {level:.3g})"
    )


def _rank(value: float | None) -> float:
    return -math.inf if value is None else value


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"
