"""What a sweep writes at the end: tables in the paper's shapes, CSV, JSON, the scatter, stats.

``results.md`` has one row per configuration (seeds pooled, Tables 5, 6, 9-13 shape) and one per
cell (Table 14 shape); in a merge grid a configuration is a (merge, method) pair and the best
merge of each method is marked (section 4.1). ``results.csv`` is one line per cell,
``results.json`` every record; with ``compare:`` the paired tests go to ``stats.md``.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mergekit_darts.analysis import stats
from mergekit_darts.analysis.comparison import compare_report, correlation_table
from mergekit_darts.analysis.sweep.cell import MERGE, is_baseline, write_json
from mergekit_darts.analysis.sweep.spec import SweepSpec
from mergekit_darts.folder import fs
from mergekit_darts.present.document import markdown_table

NO_SURGERY = "none (no surgery)"


def _mean_std(values: Sequence[float], digits: int = 1) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def varied_axes(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Settings that take more than one value over the surgery cells, seed excluded.

    In a merge grid ``merge`` always comes first, even when one merge is listed.
    """
    surgery = [r for r in records if not is_baseline(r["settings"])]
    keys = list(dict.fromkeys(k for r in surgery for k in r["settings"]))
    axes = [
        k
        for k in keys
        if k not in (stats.SEED, MERGE) and len({str(r["settings"].get(k)) for r in surgery}) > 1
    ]
    return [MERGE, *axes] if any(MERGE in r["settings"] for r in records) else axes


def config_rows(records: Sequence[Mapping[str, Any]], tasks: Sequence[str]) -> list[dict]:
    """One row per configuration (seeds pooled): the shape of the paper's ablation tables.

    In a merge grid a configuration is a (merge, method) pair, the baseline one per merge, and
    ``best`` marks the merge with the highest mean average score for each method (section 4.1).
    """
    axes = varied_axes(records)
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in records:
        settings = r["settings"]
        if is_baseline(settings):
            label = (*([settings[MERGE]] if MERGE in settings else []), "none")
        else:
            label = tuple(str(settings.get(a)) for a in axes)
        groups.setdefault(label, []).append(r)
    rows = []
    for label, members in groups.items():
        settings = members[0]["settings"]
        rhos = [statistics.fmean(m["rho_l1"].values()) for m in members if m.get("rho_l1")]
        if is_baseline(settings):
            config = {k: v for k, v in settings.items() if k in (MERGE, "surgery")}
        else:
            config = dict(zip(axes, label, strict=True))
        rows.append(
            {
                "config": config,
                "seeds": [m["settings"].get(stats.SEED) for m in members],
                "scores": {t: [m["scores"][t] for m in members] for t in tasks},
                "avg": [stats.average(m, tasks) for m in members],
                "rho_l1": rhos,
            }
        )
    if MERGE in axes:
        best: dict[str, tuple[float, dict]] = {}
        for row in rows:
            method = method_label(row["config"])
            mean = statistics.fmean(row["avg"])
            if method not in best or mean > best[method][0]:
                best[method] = (mean, row)
        for row in rows:
            row["best"] = best[method_label(row["config"])][1] is row
    return rows


def method_label(config: Mapping[str, Any]) -> str:
    """A configuration without its merge: what the best merge is chosen for."""
    return ",".join(f"{k}={v}" for k, v in config.items() if k != MERGE) or "default"


def results_markdown(records: Sequence[Mapping[str, Any]], tasks: Sequence[str]) -> str:
    """Configurations table (Tables 5, 6, 9-13 shape) and per-cell table (Table 14 shape).

    A merge grid's table has a merge column, a baseline row per merge, and ★ on the best merge
    of each method by average score; a second table lists those best merges.
    """
    axes = varied_axes(records)
    grid = MERGE in axes
    methods = [a for a in axes if a != MERGE]
    header = [*([MERGE] if grid else []), *(methods or ["config"]), *tasks, "Avg.", "ρ_L1 (%)"]
    rows, best = [], []
    all_rows = config_rows(records, tasks)
    for row in all_rows:
        config = row["config"]
        merge = [f"{config[MERGE]}{' ★' if row['best'] else ''}"] if grid else []
        if is_baseline(config):
            label = [NO_SURGERY] + ["—"] * (max(len(methods), 1) - 1)
        else:
            label = [config[a] for a in methods] or ["default"]
        rho = _mean_std([100 * x for x in row["rho_l1"]]) if row["rho_l1"] else "—"
        avg = _mean_std(row["avg"])
        rows.append([*merge, *label, *(_mean_std(row["scores"][t]) for t in tasks), avg, rho])
        if grid and row["best"]:
            method = NO_SURGERY if is_baseline(config) else method_label(config)
            best.append([method, config[MERGE], avg])
    n_seeds = max((len(r["seeds"]) for r in all_rows), default=1)
    parts = [
        "# Sweep results\n",
        f"Mean{' ± std over seeds' if n_seeds > 1 else ''}; ρ_L1 averaged over surgery tasks."
        + (" ★: the best merge of each method by Avg. (paper section 4.1).\n" if grid else "\n"),
        markdown_table(header, rows),
    ]
    if grid:
        parts += ["\n## Best merge per method\n", markdown_table(["method", MERGE, "Avg."], best)]
    parts += ["\n## Every cell\n", cells_table(records, tasks)]
    surgery = [r for r in records if not is_baseline(r["settings"])]
    correlations = stats.rho_correlations(surgery, tasks)
    if correlations:
        parts += ["\n## ρ_L1 vs. task score over cells (Table 3)\n"]
        parts += [correlation_table(correlations)]
    return "\n".join(parts) + "\n"


def cells_table(records: Sequence[Mapping[str, Any]], tasks: Sequence[str]) -> str:
    """One row per cell: its scores, average and mean rho_L1 (Table 14 shape)."""
    return markdown_table(
        ["cell", *tasks, "Avg.", "ρ_L1 (%)"],
        [
            [
                r["cell"],
                *(f"{r['scores'][t]:.1f}" for t in tasks),
                f"{stats.average(r, tasks):.1f}",
                f"{100 * statistics.fmean(r['rho_l1'].values()):.1f}" if r["rho_l1"] else "—",
            ]
            for r in records
        ],
    )


def results_csv(records: Sequence[Mapping[str, Any]], tasks: Sequence[str]) -> str:
    """One line per cell: settings, scores, average, mean rho_L1 (easy to load in pandas)."""
    keys = list(dict.fromkeys(k for r in records for k in r["settings"]))
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["cell", *keys, *tasks, "avg", "rho_l1"])
    for r in records:
        rho = statistics.fmean(r["rho_l1"].values()) if r["rho_l1"] else math.nan
        writer.writerow(
            [
                r["cell"],
                *(r["settings"].get(k, "") for k in keys),
                *(r["scores"][t] for t in tasks),
                stats.average(r, tasks),
                rho,
            ]
        )
    return buffer.getvalue()


def write_results(
    output: Path, records: Sequence[Mapping[str, Any]], spec: SweepSpec
) -> dict[str, Path]:
    """``results.{md,csv,json}``, the rho-vs-score scatter, and ``stats.md`` when asked."""
    from mergekit_darts.present.plots import plot_rho_vs_score

    tasks = list(spec.eval.tasks)
    data = {"tasks": tasks, "axes": varied_axes(records), "cells": list(records)}
    if MERGE in data["axes"]:
        rows = config_rows(records, tasks)
        data["configs"] = rows
        data["best_merge"] = {
            method_label(r["config"]): r["config"][MERGE] for r in rows if r.get("best")
        }
    write_json(output / "results.json", data)
    written = {"json": output / "results.json"}
    fs.write_text(output / "results.md", results_markdown(records, tasks))
    fs.write_text(output / "results.csv", results_csv(records, tasks))
    written |= {"markdown": output / "results.md", "csv": output / "results.csv"}
    points = {
        t: [(r["eval_rho"][t], r["scores"][t]) for r in records if r["eval_rho"].get(t) is not None]
        for t in tasks
    }
    if any(points.values()):
        written["scatter"] = plot_rho_vs_score(
            {t: p for t, p in points.items() if p}, output / "rho_vs_score.png"
        )
    if spec.compare is not None:
        markdown, comparison = compare_report(
            data,
            stats.parse_selector(spec.compare.a),
            stats.parse_selector(spec.compare.b),
            spec.compare.unit,
        )
        fs.write_text(output / "stats.md", markdown + "\n")
        write_json(output / "stats.json", comparison)
        written["stats"] = output / "stats.md"
    return written
