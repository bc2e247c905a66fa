"""The held-out verdict: keep a correction only where it beats the merge as it is, where it counts.

A task's score is decided by what the model generates after a prompt, so the verdict is measured
there: each judged calibration prompt is completed greedily by the target, and each candidate
(``{module: none}``, the merge as it is, always among them) is teacher-forced on prompt +
completion. At the positions that predict the completion (the last prompt token through the last
completion token, whose next token is the end of the sequence when the target stopped before
``completion_tokens``) four numbers per prompt say how close the corrected merge comes:

- ``completion_prefix``: how many of those positions, from the first, have the target's next
  token as the top-1 token (at the end: one of the merged model's end-of-sequence ids) before the
  first that does not. Greedy decoding emits the top-1 token, so this is exactly how many tokens of
  the target's greedy completion the corrected merge's own greedy completion reproduces (up to the
  rounding of the cached hidden states): a graded exact match, which long answers can improve
  without matching whole. It needs the merged model's LM head only, so a target with appended
  tokens (``target_vocab: prefix``) is measured too.
- ``completion_match``: 1 when the whole completion is reproduced, else 0.
- ``completion_agreement``: the share of those positions where the top-1 tokens agree.
- ``completion_rho_l1``: rho_L1 of the hidden states over those positions.

A candidate is kept only when a one-sided exact Wilcoxon signed-rank test over the judged prompts
(:func:`signed_rank_test`: the sizes of the per-prompt differences against ``none``, not only their
signs) rejects "no better than none" at ``alpha`` divided by the number of corrections tried
(Bonferroni). So when no correction beats the merge (each prompt's difference as likely negative as
positive), a correction is kept with probability at most ``alpha``. Among corrections that pass, the
best mean wins. The verdict line also says the smallest mean gain the test detects with this many
prompts (:func:`detectable_gain`), so "no gain" can be told from "too few prompts".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np
import torch

from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.calibrate.train import positions_of
from mergekit_darts.correction.darts_correction import SurgeryModule
from mergekit_darts.correction.metrics import delta, rho_from_sums

NAMES = {
    "completion_prefix": "reproduced completion tokens",
    "completion_match": "completion match",
    "completion_agreement": "completion agreement",
    "completion_rho_l1": "completion ρ_L1",
}
END_OF_COMPLETION = -1  # the reference at a position that predicts the end of the completion
VERDICT_TEST = "one-sided exact Wilcoxon signed-rank test against none, Bonferroni over corrections"
# select metric lm_eval: the same test over the dev items; on 0/1 outcomes (acc, exact_match) it
# is the exact sign test on the discordant items, which is McNemar's exact test
DEV_TEST = (
    "one-sided exact McNemar test against none over the dev items (the signed-rank test on 0/1 "
    "outcomes), Bonferroni over corrections"
)
DETECT_POWER = 0.8  # the power at which the verdict line states the smallest detectable mean gain


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
    module: SurgeryModule, held: HeldOutCompletions, rows: Sequence[int] | None = None
) -> dict[str, list[float | None]]:
    """Per judged prompt (``rows`` of ``held``, default all, in that order): the completion
    prefix, match and agreement (None without a verified merged LM head) and rho_L1 (None where
    the merge already equals the target) of ``module``."""
    head = held.merged.head
    with_logits = head is not None and bool(head.verified)
    module = module.eval()
    device = held.merged.hidden.device
    eos = torch.tensor(sorted(held.eos_ids), dtype=torch.long, device=device)
    scores: dict[str, list[float | None]] = {name: [] for name in NAMES}
    for row in range(held.predicting.shape[0]) if rows is None else rows:
        keep = held.predicting[row].to(device)
        h = held.merged.hidden[row][keep].to(torch.float32)  # [P, H]
        h_star = held.target.hidden[row][keep].to(torch.float32)
        h_hat = module(h, positions_of(held.merged.mask[row : row + 1])[0][keep])
        before, after = delta(h, h_star).double().sum(), delta(h_hat, h_star).double().sum()
        scores["completion_rho_l1"].append(rho_from_sums(before, after))
        if not with_logits:
            for name in ("completion_prefix", "completion_match", "completion_agreement"):
                scores[name].append(None)
            continue
        wanted = held.reference[row].to(device)[keep]
        top1 = head.top1(h_hat).to(device)
        agrees = torch.where(wanted == END_OF_COMPLETION, torch.isin(top1, eos), top1 == wanted)
        agree, prefix = int(agrees.sum()), int(agrees.long().cumprod(0).sum())
        scores["completion_prefix"].append(float(prefix))
        scores["completion_agreement"].append(agree / h.shape[0])
        scores["completion_match"].append(float(agree == h.shape[0]))
    return scores


def cross_fitted_scores(
    modules: Sequence[SurgeryModule],
    held: HeldOutCompletions,
    order: Sequence[int],
    judged: Sequence[torch.Tensor],
) -> dict[str, list[float | None]]:
    """Per judged prompt (``order``: the prompt of each row of ``held``), the scores of the one
    module of ``modules`` whose split judged it (``judged[k]``: the prompts module ``k`` did not
    train on)."""
    where = {prompt: row for row, prompt in enumerate(order)}
    scores: dict[str, list[float | None]] = {}
    for module, prompts in zip(modules, judged, strict=True):
        rows = [where[prompt] for prompt in prompts.tolist()]
        for name, values in completion_scores(module, held, rows).items():
            column = scores.setdefault(name, [None] * len(order))
            for row, value in zip(rows, values, strict=True):
                column[row] = value
    return scores


def signed_rank_test(
    candidate: Sequence[float | None], none: Sequence[float | None]
) -> dict[str, Any]:
    """One-sided exact Wilcoxon signed-rank test of "``candidate`` scores above ``none``".

    Over the paired prompts (missing values dropped), the differences of zero carry no
    information and are dropped too (Wilcoxon's treatment); the rest are ranked by size, tied sizes
    sharing their mean rank. ``statistic`` is the rank sum of the positive differences and ``p`` the
    share of the ``2**n`` ways to sign those ranks that reach it: exact, given the ranks, whenever
    each difference is as likely negative as positive (no candidate better than ``none``). With
    0/1 outcomes every rank is equal and this is the sign test. ``better`` / ``worse``: prompts
    the candidate scores above / below ``none``; ``p`` is 1 with no difference.
    """
    paired = np.array(_differences(candidate, none), dtype=np.float64)
    differences = paired[paired != 0]
    record = {
        "better": int((differences > 0).sum()),
        "worse": int((differences < 0).sum()),
        "prompts": len(paired),
    }
    if not differences.size:
        return {**record, "statistic": 0.0, "p": 1.0}
    doubled = _doubled_ranks(np.abs(differences))  # integers: mean ranks are halves at most
    observed = int(doubled[differences > 0].sum())
    null = np.zeros(int(doubled.sum()) + 1)  # P(doubled positive rank sum = s), built rank by rank
    null[0] = 1.0
    for rank in doubled:
        null[rank:] = 0.5 * null[rank:] + 0.5 * null[:-rank]
        null[:rank] *= 0.5
    return {**record, "statistic": observed / 2, "p": min(1.0, float(null[observed:].sum()))}


def _doubled_ranks(sizes: np.ndarray) -> np.ndarray:
    """Twice the mean ranks (1 = smallest) of ``sizes``, ties sharing theirs: integers."""
    order = np.argsort(sizes, kind="stable")
    ranks = np.empty(len(sizes), dtype=np.int64)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and sizes[order[end + 1]] == sizes[order[start]]:
            end += 1
        ranks[order[start : end + 1]] = start + end + 2  # (start + 1) + (end + 1)
        start = end + 1
    return ranks


def fewest_changes(level: float) -> int:
    """How many prompts must change, every one for the better, before the test can pass at
    ``level``: the smallest one-sided p-value with ``n`` changed prompts is ``2**-n``."""
    return math.ceil(math.log2(1 / level) - 1e-12)


def detectable_gain(differences: Sequence[Sequence[float]], level: float) -> float | None:
    """The smallest mean gain over ``none`` the test detects with power :data:`DETECT_POWER`.

    From the normal approximation of a one-sided paired test at ``level`` with ``n`` prompts,
    ``(z[1 - level] + z[power]) * s / sqrt(n)``, where ``s`` is the spread the null gives the
    per-prompt differences against ``none`` observed over the corrections tried (the root mean
    square, pooled: a sign-flip null has variance ``sum d**2``), and ``n`` is scaled by 3/pi, the
    signed-rank test's efficiency against the t-test for normal differences. Never below what the
    exact test needs at all: :func:`fewest_changes` prompts, each by the smallest change seen.
    None when no correction changed any prompt's outcome (nothing to scale by).
    """
    rows = [np.asarray(d, dtype=np.float64) for d in differences if len(d)]
    if not rows or not any(r.any() for r in rows):
        return None
    n = min(len(r) for r in rows)
    spread = math.sqrt(float(np.mean([np.mean(r**2) for r in rows])))
    smallest = min(float(np.abs(r[r != 0]).min()) for r in rows if r.any())
    z = NormalDist().inv_cdf
    normal = (z(1 - level) + z(DETECT_POWER)) * spread / math.sqrt(n * 3 / math.pi)
    return max(normal, fewest_changes(level) * smallest / n)


def mean(values: Sequence[float | None]) -> float | None:
    """Mean of the values that exist; None if none does."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


@dataclass(frozen=True)
class Wording:
    """How a verdict line names what was judged: the metric, the judged set and its unit."""

    name: str  # the metric, as the line says it
    judged: str = "held-out"
    unit: str = "prompts"
    where: str = "held-out completions"
    test: str = "signed-rank"


@dataclass(frozen=True)
class Decision:
    """What the verdict kept, the line that says so, and what its test could see."""

    chosen: int  # index of the kept candidate
    line: str
    detectable: dict[str, Any] | None = None  # the smallest detectable mean gain, and at what


def decide(
    entries: list[dict[str, Any]],
    labels: Sequence[str],
    metric: str,
    alpha: float,
    wording: Wording | None = None,
) -> Decision:
    """What to keep, from the candidates' manifest entries (each with ``verdict`` per-prompt
    scores, or ``diverged``); records each correction's test in its entry.

    ``none`` is kept unless a correction's signed-rank test against it passes at ``alpha`` / the
    number of corrections measured; among those that pass, the best mean of ``metric`` wins
    (the first on a tie). ``wording`` names what was judged (default: held-out completions).
    """
    words = wording or Wording(NAMES[metric])
    none = next(i for i, e in enumerate(entries) if e["module"] == "none")
    baseline = entries[none]["verdict"][metric]
    tried = [
        i
        for i, e in enumerate(entries)
        if i != none and "diverged" not in e and e["module"] != "none"
    ]
    name, unit = words.name, words.unit
    base_mean = mean(baseline)
    if not tried:
        corrections = any(e["module"] != "none" for e in entries)
        why = (
            "every correction's training diverged" if corrections else "none was the only candidate"
        )
        return Decision(none, f"kept no correction: {why}")
    level = alpha / len(tried)
    for i in tried:
        test = signed_rank_test(entries[i]["verdict"][metric], baseline)
        entries[i]["test"] = {**test, "level": level}
    differences = [_differences(entries[i]["verdict"][metric], baseline) for i in tried]
    gain = detectable_gain(differences, level)
    prompts = max(entries[i]["test"]["prompts"] for i in tried)
    detectable = {"mean_gain": gain, "power": DETECT_POWER, "prompts": prompts, "level": level}
    passing = [i for i in tried if entries[i]["test"]["p"] <= level]
    best = max(passing or tried, key=lambda i: _rank(entries[i]["held_out"][metric]))
    test, score = entries[best]["test"], entries[best]["held_out"][metric]
    counts = (
        f"better on {test['better']}, worse on {test['worse']} of {test['prompts']} {unit}, "
        f"{words.test} p = {test['p']:.3g}"
    )
    if fewest_changes(level) > prompts:
        detectable["mean_gain"] = None
        power = (
            f"with {prompts} {unit} no correction can pass (the test needs at least "
            f"{fewest_changes(level)} {unit} changed, all for the better)"
        )
    elif gain is None:
        power = f"no correction changed any of the {prompts} {unit}' {name}"
    else:
        power = (
            f"with {prompts} {unit} the test detects a mean gain of >= {gain:.3g} in {name} "
            f"({DETECT_POWER:.0%} power)"
        )
    if passing:
        return Decision(
            best,
            f"kept {labels[best]}: {words.judged} {name} {_fmt(score)}, none {_fmt(base_mean)} "
            f"({counts} <= {level:.3g}); {power}",
            detectable,
        )
    below = all(_rank(entries[i]["held_out"][metric]) < _rank(base_mean) for i in tried)
    why = (
        "every candidate scored below the merge"
        if below
        else f"no candidate beat the merge by the {words.test} test"
    )
    return Decision(
        none,
        f"kept no correction: {why} on {words.where} (best {labels[best]}: {name} "
        f"{_fmt(score)}, none {_fmt(base_mean)}; {counts} > {level:.3g}); {power}",
        detectable,
    )


def _differences(candidate: Sequence[float | None], none: Sequence[float | None]) -> list[float]:
    """``candidate - none`` per prompt where both were measured."""
    return [a - b for a, b in zip(candidate, none, strict=True) if a is not None and b is not None]


def _rank(value: float | None) -> float:
    return -math.inf if value is None else value


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3g}"


JOINT_TEST = (
    "one-sided exact Wilcoxon signed-rank test against none over every task's judged prompts, "
    "Bonferroni over corrections; refused where the same test finds it worse than none on a "
    "task at alpha"
)


def decide_joint(
    entries: list[dict[str, Any]],
    labels: Sequence[str],
    none: dict[str, list[float | None]],
    metric: str,
    alpha: float,
) -> Decision:
    """What the joint correction keeps (``chosen`` -1: none), from its candidates' entries (each
    with ``verdict``: per task, per judged prompt, the scores of ``metric``) and ``none``'s
    scores per task; records each candidate's tests in its entry.

    A candidate is kept when the signed-rank test over every task's prompts pooled rejects "no
    better than none" at ``alpha`` / the number of candidates, and on no task the test of "none
    better than it" rejects at ``alpha`` (no Bonferroni there: harm is refused more readily than
    gain is accepted). Among those kept, the best pooled mean wins (the first on a tie).
    """
    tasks = list(none)
    pooled_none = [v for task in tasks for v in none[task]]
    level = alpha / len(entries)
    for entry in entries:
        scores = entry["verdict"]
        pooled = [v for task in tasks for v in scores[task]]
        entry["test"] = {**signed_rank_test(pooled, pooled_none), "level": level}
        entry["tasks"] = {task: _task_result(scores[task], none[task]) for task in tasks}
        entry["held_out"] = {metric: mean(pooled)}
    harmed = [
        [task for task, result in e["tasks"].items() if result["p_worse"] <= alpha] for e in entries
    ]
    passing = [i for i, e in enumerate(entries) if e["test"]["p"] <= level and not harmed[i]]
    best = max(passing or range(len(entries)), key=lambda i: _rank(entries[i]["held_out"][metric]))
    test, name = entries[best]["test"], NAMES[metric]
    counts = (
        f"pooled {name} {_fmt(entries[best]['held_out'][metric])}, none {_fmt(mean(pooled_none))}: "
        f"better on {test['better']}, worse on {test['worse']} of {test['prompts']} prompts of "
        f"{len(tasks)} tasks, signed-rank p = {test['p']:.3g}"
    )
    if passing:
        return Decision(
            best,
            f"kept joint {labels[best]}: {counts} <= {level:.3g}; worse than none on no task "
            f"(smallest p = {min(r['p_worse'] for r in entries[best]['tasks'].values()):.3g} "
            f"> {alpha:g})",
        )
    if harmed[best]:
        why = f"worse than none on {', '.join(harmed[best])} (p <= {alpha:g})"
    else:
        why = f"{counts} > {level:.3g}"
    return Decision(-1, f"kept no joint correction (best {labels[best]}: {why})")


def _task_result(scores: list[float | None], none: list[float | None]) -> dict[str, Any]:
    """One task's line of a joint candidate: its mean and none's, and both one-sided tests."""
    better, worse = signed_rank_test(scores, none), signed_rank_test(none, scores)
    return {
        "mean": mean(scores),
        "none": mean(none),
        "better": better["better"],
        "worse": better["worse"],
        "prompts": better["prompts"],
        "p_better": better["p"],
        "p_worse": worse["p"],
    }
