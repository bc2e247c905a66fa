"""Does the default verdict keep what helps, and only that? One line per (merge, domain) cell.

Per cell: the best fixed row among the default's candidates (calibrated on the same data), its
exact-match difference from no surgery, the default's difference, and what the default kept on
each surgery seed, with intervals over surgery seeds and items (report.py's two-level bootstrap
and its rule: a difference counts when the interval excludes zero and every seed agrees).
Pooled over families, two numbers judge the verdict, and a third measures them:

- safety: cells where the default is significantly below no surgery (should be none);
- power: over the cells where one of its candidates is significantly better than no surgery,
  the mean share of that candidate's gain the default recovers;
- a yardstick for power, what any such verdict could reach: over the same cells, the mean of the
  most power the verdict's test can have to see that gain on the judged prompts
  (:func:`exact_test_ceiling`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import binom

from demo.configs import NO_CORRECTION, SELECT, Variant, fixed_variant, surgery_task
from demo.domains import DOMAIN_NAMES
from demo.evaluation import Evaluation
from demo.report import BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED, Row, delta_cell, item_differences
from mergekit_darts.analysis.stats import seeded_bootstrap
from mergekit_darts.calibrate.verdict import fewest_changes, signed_rank_test
from mergekit_darts.folder.manifest import Manifest

NONE_KEPT = "none"
BREAK_RATE_STEPS = 400  # exact_test_ceiling searches break rates in steps of 1 / this


@cache
def _fewest_better(changed: int, level: float) -> int | None:
    """The fewest of ``changed`` 0/1 prompt outcomes that must go up (the rest down) for the
    verdict's test to pass at ``level``; None when none suffices (fewer than
    :func:`fewest_changes`). Its p-value falls as more go up, so a bisection finds it."""

    def passes(better: int) -> bool:
        up = [1.0] * better + [0.0] * (changed - better)
        return signed_rank_test(up, [1.0 - x for x in up])["p"] <= level

    if changed < fewest_changes(level):
        return None
    low, high = 0, changed  # passes(high); the answer lies in [low, high]
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if passes(middle) else (middle + 1, high)
    return high


def exact_test_ceiling(gain: float, prompts: int, level: float) -> float:
    """The most power the verdict's test (on 0/1 outcomes the exact sign test, McNemar's) has at
    ``level`` over ``prompts`` judged prompts, when each prompt's outcome moves as an evaluation
    item's exact match does under a correction that gains ``gain`` (a share, 0 < gain <= 1): up
    with probability ``gain + q``, down with ``q``, maximised over the break rate ``q``.

    Why: it says how much of a gain any verdict that keeps only what an exact test at its level
    shows could recover with this many prompts, so the power figure has a yardstick."""
    if not 0 < gain <= 1:
        raise ValueError(f"gain {gain} is not a share in (0, 1]")
    changed = np.arange(prompts + 1)
    # where no count passes, ask for one more than there are: its tail probability is 0
    need = [_fewest_better(m, level) for m in range(prompts + 1)]
    need_up = np.array([m + 1 if k is None else k for m, k in enumerate(need)])
    best = 0.0
    for step in range(BREAK_RATE_STEPS + 1):
        down = step / BREAK_RATE_STEPS
        moved = gain + 2 * down
        if moved > 1:
            break
        power = binom.pmf(changed, prompts, moved) * binom.sf(
            need_up - 1, changed, (gain + down) / moved
        )
        best = max(best, float(power.sum()))
    return best


def _difference(
    seeds: Mapping[int, Evaluation], reference: Evaluation, domain: str
) -> dict[str, Any]:
    """One domain's exact-match difference from `reference` over surgery seeds and items."""
    diffs = {s: {domain: item_differences(e, reference)[domain]} for s, e in sorted(seeds.items())}
    two = seeded_bootstrap(diffs, BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED)
    return {"mean": two.mean, "ci95": [two.low, two.high], "direction": two.direction}


def _kept(manifest: Manifest, select: Variant, domain: str) -> str:
    """The label of the candidate the verdict of `select` kept for `domain` (`none`: none)."""
    selection = manifest.tasks[surgery_task(domain) + select.suffix].selection
    candidate = selection["candidates"][selection["chosen"]]
    if candidate["module"] == NO_CORRECTION["module"]:
        return NONE_KEPT
    return fixed_variant(candidate, select.continuation_tokens).label


def cells(
    rows: Sequence[Row], select_rows: Sequence[Variant], manifests: Mapping[str, list[Manifest]]
) -> list[dict[str, Any]]:
    """The cells of one run: every merge × calibration group (one per `select` variant shown)
    × domain. `manifests[merge]` holds each surgery seed's manifest, in seed order."""
    out = []
    by_label = {(row.group, row.label): row for row in rows}
    for merge, seed_manifests in manifests.items():
        none = by_label[(merge, "None (merged)")].evaluation
        for select in select_rows:
            default = by_label[(merge, select.label)]
            candidates = [
                fixed_variant(c, select.continuation_tokens).label
                for c in SELECT["candidates"]
                if c["module"] != NO_CORRECTION["module"]
            ]
            shown = [by_label[(merge, c)] for c in candidates if (merge, c) in by_label]
            for domain in DOMAIN_NAMES:
                fixed = {row.label: _difference(_seeds(row), none, domain) for row in shown}
                best = max(fixed, key=lambda label: fixed[label]["mean"])
                out.append(
                    {
                        "merge": merge,
                        "calibration": "completions" if select.continuation_tokens else "prompts",
                        "domain": domain,
                        "best_fixed": {"label": best, **fixed[best]},
                        "fixed": fixed,
                        "default": _difference(_seeds(default), none, domain),
                        "kept": [_kept(m, select, domain) for m in seed_manifests],
                        "judged": _judged(seed_manifests[0], select, domain),
                    }
                )
    return out


def _judged(manifest: Manifest, select: Variant, domain: str) -> dict[str, Any]:
    """How many prompts the verdict judged and at what level (each correction's test)."""
    detectable = manifest.tasks[surgery_task(domain) + select.suffix].selection["detectable"]
    return {"prompts": detectable["prompts"], "level": detectable["level"]}


def _seeds(row: Row) -> dict[int, Evaluation]:
    return row.seeds or {0: row.evaluation}


def judged(cell_records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Safety and power over cells (see the module docstring)."""
    below = [c for c in cell_records if c["default"]["direction"] == "worse"]
    shares, ceilings = [], []
    for cell in cell_records:
        better = [f for f in cell["fixed"].values() if f["direction"] == "better"]
        if better:
            gain = max(f["mean"] for f in better)
            shares.append(cell["default"]["mean"] / gain)
            judged_at = cell["judged"]
            ceilings.append(
                exact_test_ceiling(gain / 100, judged_at["prompts"], judged_at["level"])
            )
    return {
        "cells": len(cell_records),
        "default_below_none": len(below),
        "cells_with_a_significant_candidate": len(shares),
        "mean_share_recovered": statistics.fmean(shares) if shares else None,
        "mean_exact_test_ceiling": statistics.fmean(ceilings) if ceilings else None,
    }


def markdown(named: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """One table over families (`named[family]` = its cells), then safety and power."""
    head = [
        "Family",
        "Merge",
        "Calibration",
        "Domain",
        "Best fixed candidate: Δ vs none [95% CI]",
        "Default: Δ vs none [95% CI]",
        "Default kept (per surgery seed)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for family, records in named.items():
        for c in records:
            best = c["best_fixed"]
            lines.append(
                "| "
                + " | ".join(
                    [
                        family,
                        c["merge"],
                        c["calibration"],
                        c["domain"],
                        f"{best['label']}: {delta_cell(best)}",
                        delta_cell(c["default"]),
                        " / ".join(c["kept"]),
                    ]
                )
                + " |"
            )
    total = judged([c for records in named.values() for c in records])
    share, ceiling = total["mean_share_recovered"], total["mean_exact_test_ceiling"]
    lines += [
        "",
        f"Cells: {total['cells']}. The default significantly below no surgery: "
        f"{total['default_below_none']}. Cells where a candidate is significantly better than no "
        f"surgery: {total['cells_with_a_significant_candidate']}; the default recovers "
        + _percent(share)
        + " of that candidate's gain on average. Yardstick: an exact test at the verdict's level "
        "over as many prompts, each moving as the evaluation items' exact match did, sees that "
        "gain at most " + _percent(ceiling) + " of the time on average.",
    ]
    return "\n".join(lines)


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.0f} %"


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m demo.verdict_cells NAME=RESULTS.json ...`: one table over several runs."""
    parser = argparse.ArgumentParser(prog="python -m demo.verdict_cells", description=main.__doc__)
    parser.add_argument("runs", nargs="+", help="FAMILY=path/to/results.json, one per run")
    named = {}
    for run in parser.parse_args(argv).runs:
        name, sep, path = run.partition("=")
        if not sep or not Path(path).is_file():
            parser.error(f"{run!r} is not FAMILY=RESULTS.json naming a file (run the demo first)")
        records = json.loads(Path(path).read_text()).get("verdict_cells")
        if records is None or any("judged" not in c for c in records):
            parser.error(
                f"{path} has no verdict_cells with their judged prompts: re-run the demo "
                "(cached: seconds) first"
            )
        named[name] = records
    print(markdown(named))


if __name__ == "__main__":
    main()
