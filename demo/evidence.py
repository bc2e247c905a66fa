"""Which held-out metric predicts the task score, and does `select` find the best fixed variant?

Each `select` task of the demo trains the fixed variants above it as candidates and measures them
on calibration prompts they did not train on (every prompt once over the default's folds, or a
held-out share); with refit, the module it saves is byte for byte the fixed variant it chose. So
every fixed variant's exact match can be paired with its candidate's held-out numbers, and the
unrepaired merge (the `{module: none}` candidate) with the "before" numbers, per merge and domain.
Numbers from prompt-only and completion calibration are not comparable (other token sets), so each
calibration group is analysed on its own.

The verdict's per-prompt numbers on the target's completions of the held-out prompts
(calibrate.verdict) are kept with each point, so :func:`verdict_outcomes` can say what the verdict
would keep under each of its metrics, and whether that is at least as good as no surgery on the
evaluation items; ``python -m demo.evidence results.json ...`` pools several
family seeds' ``results.json``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy.stats import spearmanr

from demo.configs import VARIANTS, Variant, fixed_variant, surgery_task
from demo.domains import DOMAIN_NAMES
from demo.report import Row
from mergekit_darts.calibrate.verdict import decide
from mergekit_darts.config.schema import VERDICT_METRICS, SelectConfig
from mergekit_darts.folder.manifest import Manifest

NONE_LABEL = "None (merged)"
# metric -> sign that makes "higher is better" (KL is lower-is-better); `completion_agreement`
# is agreement on the calibration completions' tokens, the verdict's metrics are on the target's
# completions of the held-out prompts
METRICS = {
    "agreement": 1,
    "kl": -1,
    "rho_l1": 1,
    "completion_agreement": 1,
    **{f"verdict_{m}": 1 for m in VERDICT_METRICS},
}
ALPHA = SelectConfig().alpha  # the verdict's default level


@dataclass(frozen=True)
class Point:
    """One (merge, calibration group, domain, variant): held-out metrics and exact match."""

    merge: str
    group: str  # "prompts" | "completions"
    domain: str
    variant: str
    exact_match: float
    metrics: dict[str, float | None]
    chosen: bool = False
    verdict: dict[str, list[float | None]] = field(default_factory=dict)  # per held-out prompt


def collect(method: str, manifest: Manifest, scores: Mapping[str, dict]) -> list[Point]:
    """Points of one merge; ``scores`` maps a row label to its exact match per domain."""
    points = []
    for variant in (v for v in VARIANTS if v.selects):
        group = "completions" if variant.continuation_tokens else "prompts"
        for domain in DOMAIN_NAMES:
            entry = manifest.tasks[surgery_task(domain) + variant.suffix]
            selection = entry.selection
            for index, candidate in enumerate(selection["candidates"]):
                numbers = candidate["held_out"]
                verdict = {f"verdict_{m}": numbers.get(m) for m in VERDICT_METRICS}
                if candidate["module"] == "none":  # the merge as it is: the no-surgery row
                    label = NONE_LABEL
                    metrics = _before(entry.held_out, numbers)
                else:
                    label = fixed_variant(candidate, variant.continuation_tokens).label
                    metrics = {
                        **{k: numbers[k] for k in ("agreement", "kl", "rho_l1")},
                        "completion_agreement": numbers.get("completion", {}).get("agreement"),
                    }
                points.append(
                    Point(
                        method,
                        group,
                        domain,
                        label,
                        scores[label][domain],
                        {**metrics, **verdict},
                        chosen=index == selection["chosen"],
                        verdict=candidate.get("verdict", {}),
                    )
                )
    return points


def _before(held: dict[str, Any] | None, none: dict[str, Any]) -> dict[str, float | None]:
    """The merge's own held-out numbers: the held-out share's "before" values, or, when every
    prompt was judged in a fold (no held-out share), the `none` candidate's pooled ones."""
    if held is None:
        agreement, kl = none["agreement"], none["kl"]
        completion = none.get("completion", {}).get("agreement")
    else:
        agreement, kl = held["all"]["agreement_before"], held["all"]["kl_before"]
        completion = held.get("completion", {}).get("agreement_before")
    return {"agreement": agreement, "kl": kl, "rho_l1": 0.0, "completion_agreement": completion}


def _spearman(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    if len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return float(spearmanr(xs, ys).statistic)


def correlations(points: Sequence[Point]) -> list[dict[str, Any]]:
    """Spearman rho of each metric (signed so higher = better) with exact match, per group:
    pooled over merges x domains x variants, and the mean within each (merge, domain)."""
    rows = []
    for group in ("prompts", "completions"):
        mine = [p for p in points if p.group == group]
        for metric, sign in METRICS.items():
            usable = [p for p in mine if p.metrics.get(metric) is not None]
            if not usable:
                continue
            pooled = _spearman(
                [sign * p.metrics[metric] for p in usable], [p.exact_match for p in usable]
            )
            within = []
            for merge, domain in {(p.merge, p.domain) for p in usable}:
                cell = [p for p in usable if (p.merge, p.domain) == (merge, domain)]
                value = _spearman(
                    [sign * p.metrics[metric] for p in cell], [p.exact_match for p in cell]
                )
                if value is not None:
                    within.append(value)
            rows.append(
                {
                    "group": group,
                    "metric": metric,
                    "points": len(usable),
                    "pooled": pooled,
                    "within_mean": sum(within) / len(within) if within else None,
                    "within_cells": len(within),
                }
            )
    return rows


def selection_outcomes(
    points: Sequence[Point], select_scores: Mapping[tuple[str, str], dict[str, float]]
) -> list[dict[str, Any]]:
    """Per merge and group: mean exact match of the select row (measured), of what selecting by
    each metric would keep, of each fixed variant's best, and of the per-domain oracle."""
    out = []
    for merge in dict.fromkeys(p.merge for p in points):
        for group in ("prompts", "completions"):
            # no surgery is a select candidate too (`{module: none}`)
            cands = [p for p in points if p.merge == merge and p.group == group]
            if not cands:
                continue
            by_variant: dict[str, list[float]] = {}
            for p in cands:
                by_variant.setdefault(p.variant, []).append(p.exact_match)
            fixed_means = {v: sum(s) / len(s) for v, s in by_variant.items()}
            picks = {}
            for metric, sign in METRICS.items():
                chosen = []
                for domain in DOMAIN_NAMES:
                    cell = [
                        p for p in cands if p.domain == domain and p.metrics.get(metric) is not None
                    ]
                    if cell:
                        chosen.append(max(cell, key=lambda p: sign * p.metrics[metric]).exact_match)
                if len(chosen) == len(DOMAIN_NAMES):
                    picks[metric] = sum(chosen) / len(chosen)
            oracle = [max(p.exact_match for p in cands if p.domain == d) for d in DOMAIN_NAMES]
            measured = select_scores[(merge, group)]
            out.append(
                {
                    "merge": merge,
                    "group": group,
                    "select": sum(measured.values()) / len(measured),
                    "kept": {p.domain: p.variant for p in cands if p.chosen},
                    "by_metric": picks,
                    "best_fixed": max(fixed_means.values()),
                    "best_fixed_label": max(fixed_means, key=fixed_means.get),
                    "fixed": fixed_means,
                    "oracle": sum(oracle) / len(oracle),
                }
            )
    return out


def verdict_outcomes(points: Sequence[Point], alpha: float = ALPHA) -> list[dict[str, Any]]:
    """Per calibration group and verdict metric: over the (merge, domain) cells, what the verdict
    (signed-rank test against none at ``alpha`` / corrections, calibrate.verdict.decide) keeps, and
    its exact match on the evaluation items against no surgery's."""
    rows = []
    for group in ("prompts", "completions"):
        mine = [p for p in points if p.group == group and p.verdict]
        cells = list(dict.fromkeys((p.merge, p.domain) for p in mine))
        for metric in VERDICT_METRICS:
            deltas, kept = [], 0
            for cell in cells:
                cands = [p for p in mine if (p.merge, p.domain) == cell]
                if any(p.verdict.get(metric) is None or None in p.verdict[metric] for p in cands):
                    continue  # no comparable heads: the metric was not measured
                entries = [
                    {
                        "module": "none" if p.variant == NONE_LABEL else p.variant,
                        "held_out": {metric: p.metrics[f"verdict_{metric}"]},
                        "verdict": p.verdict,
                    }
                    for p in cands
                ]
                index = decide(entries, [p.variant for p in cands], metric, alpha).chosen
                none = next(p for p in cands if p.variant == NONE_LABEL)
                kept += cands[index].variant != NONE_LABEL
                deltas.append(cands[index].exact_match - none.exact_match)
            if deltas:
                rows.append(
                    {
                        "group": group,
                        "metric": metric,
                        "cells": len(deltas),
                        "kept_correction": kept,
                        "at_least_none": sum(d >= 0 for d in deltas),
                        "mean_delta": sum(deltas) / len(deltas),
                        "min_delta": min(deltas),
                        "max_delta": max(deltas),
                    }
                )
    return rows


def verdict_markdown(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The verdict table: per group and metric, what it kept and how that scored."""
    lines = [
        "What the verdict keeps (signed-rank test against none on the target's completions of the "
        f"held-out prompts, alpha {ALPHA} / corrections), per (merge, domain) cell; Δ = exact "
        "match (points) of what it kept minus no surgery, on the evaluation items.",
        "",
        "| calibration | verdict metric | cells | kept a correction | kept ≥ none | mean Δ | "
        "min Δ | max Δ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['group']} | {r['metric']} | {r['cells']} | {r['kept_correction']} | "
            f"{r['at_least_none']} | {r['mean_delta']:+.1f} | {r['min_delta']:+.1f} | "
            f"{r['max_delta']:+.1f} |"
        )
    return lines


def correlation_markdown(points: Sequence[Point]) -> list[str]:
    """The Spearman table: each metric against exact match, pooled and within cells."""
    lines = [
        "Spearman rank correlation of each held-out metric with exact match (KL negated, so "
        "positive = the metric ranks like the score). Pooled: every merge × domain × variant "
        "(incl. no surgery) of the group; within: mean over (merge, domain) cells whose exact "
        "match varies.",
        "",
        "| calibration | metric | points | pooled ρ_s | within-cell mean ρ_s (cells) |",
        "|---|---|---|---|---|",
    ]
    for row in correlations(points):
        pooled_rho = "–" if row["pooled"] is None else f"{row['pooled']:+.2f}"
        within = "–" if row["within_mean"] is None else f"{row['within_mean']:+.2f}"
        lines.append(
            f"| {row['group']} | {row['metric']} | {row['points']} | {pooled_rho} | "
            f"{within} ({row['within_cells']}) |"
        )
    return lines


def markdown(points: Sequence[Point], outcomes: Sequence[Mapping[str, Any]]) -> str:
    """The two tables the README quotes."""
    lines = correlation_markdown(points)
    lines += [
        "",
        "Mean exact match (%) over the three domains: the `select` row as evaluated, what "
        "selection by each metric would keep, the best single fixed variant of the merge, and "
        "the per-domain oracle (best variant of each domain).",
        "",
        "| merge | calibration | select (verdict), measured | by agreement | by KL | by ρ_L1 "
        "| by completion agreement | best fixed | oracle |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        picks = [
            "–" if (v := o["by_metric"].get(m)) is None else f"{v:.1f}"
            for m in ("agreement", "kl", "rho_l1", "completion_agreement")
        ]
        lines.append(
            f"| {o['merge']} | {o['group']} | {o['select']:.1f} | {' | '.join(picks)} | "
            f"{o['best_fixed']:.1f} ({o['best_fixed_label']}) | {o['oracle']:.1f} |"
        )
    return "\n".join([*lines, "", *verdict_markdown(verdict_outcomes(points))])


def plain_evidence(
    rows: Sequence[Row], shown: Sequence[Variant], cell_records: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """How the plain kinds fare in one run: how often the default kept one (over the verdict
    cells and surgery seeds), and per merge what share of the best module row's gain over no
    surgery the best plain row keeps (fixed rows calibrated on prompts: the same captures).
    Why: a plain kind ships as an ordinary checkpoint, so its cost is what it gives up."""
    plain_labels = {v.label for v in VARIANTS if v.plain}
    verdicts = [k for c in cell_records for k in c["kept"]]
    fixed = [v for v in shown if not v.selects and not v.continuation_tokens]
    merges = []
    for merge in dict.fromkeys(row.group for row in rows if row.kind == "surgery"):
        gain = {
            row.label: (row.delta_over_seeds or row.delta_vs_none)["mean"]
            for row in rows
            if row.group == merge and row.kind == "surgery"
        }
        module = max((v.label for v in fixed if not v.plain), key=gain.__getitem__)
        plain = max((v.label for v in fixed if v.plain), key=gain.__getitem__)
        share = gain[plain] / gain[module] if gain[module] > 0 else None
        merges.append(
            {
                "merge": merge,
                "best_module": {"label": module, "delta": gain[module]},
                "best_plain": {"label": plain, "delta": gain[plain]},
                "share_kept": share,
            }
        )
    shares = [m["share_kept"] for m in merges if m["share_kept"] is not None]
    return {
        "verdicts": len(verdicts),
        "kept_plain": sum(k in plain_labels for k in verdicts),
        "kept_by_label": {label: verdicts.count(label) for label in sorted(set(verdicts))},
        "cells": len(cell_records),
        "cells_kept_plain": sum(any(k in plain_labels for k in c["kept"]) for c in cell_records),
        "merges": merges,
        "mean_share_kept": sum(shares) / len(shares) if shares else None,
    }


def plain_markdown(evidence: Mapping[str, Any]) -> str:
    """The plain kinds' evidence lines (:func:`plain_evidence`)."""
    kept = ", ".join(f"{label} {n}" for label, n in evidence["kept_by_label"].items())
    lines = [
        f"Plain kinds: the default (`select`) kept head or norm in {evidence['kept_plain']} of "
        f"{evidence['verdicts']} verdicts (cells × surgery seeds; {evidence['cells_kept_plain']} "
        f"of {evidence['cells']} cells on at least one seed). Kept: {kept}.",
        "",
        "| Merge | best module row: Δ vs none | best plain row: Δ vs none | share of the gain kept |",
        "|---|---|---|---|",
    ]
    for m in evidence["merges"]:
        share = "n/a (no gain)" if m["share_kept"] is None else f"{100 * m['share_kept']:.0f} %"
        module, plain = m["best_module"], m["best_plain"]
        lines.append(
            f"| {m['merge']} | {module['label']}: {module['delta']:+.1f} | "
            f"{plain['label']}: {plain['delta']:+.1f} | {share} |"
        )
    mean = evidence["mean_share_kept"]
    lines += [
        "",
        "Mean share of the best module row's gain that the best plain row keeps, over the merges "
        "where a module row gains: " + ("n/a" if mean is None else f"{100 * mean:.0f} %") + ".",
    ]
    return "\n".join(lines)


def pooled(paths: Sequence[str | Path]) -> str:
    """The correlation and verdict tables over several `--full` runs' ``results.json`` (family
    seeds): each run's merges count as their own (merge, domain) cells."""
    points = []
    for number, path in enumerate(paths):
        for record in json.loads(Path(path).read_text())["held_out"]:
            record = {**record, "merge": f"{record['merge']} (run {number})"}
            points.append(Point(**record))
    runs = f"Pooled over {len(paths)} runs: " + ", ".join(str(p) for p in paths)
    lines = [runs, "", *correlation_markdown(points), ""]
    return "\n".join([*lines, *verdict_markdown(verdict_outcomes(points))])


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m demo.evidence RESULTS.json ...`: the pooled tables."""
    parser = argparse.ArgumentParser(prog="python -m demo.evidence", description=pooled.__doc__)
    parser.add_argument("results", nargs="+", type=Path, help="results.json of `--full` runs")
    opts = parser.parse_args(argv)
    missing = [str(p) for p in opts.results if not p.is_file()]
    if missing:
        parser.error(f"no such results.json: {', '.join(missing)} (run the demo with --full first)")
    print(pooled(opts.results))


if __name__ == "__main__":
    main()
