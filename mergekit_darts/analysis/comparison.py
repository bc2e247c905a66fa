"""An a-vs-b comparison of a sweep, shaped like the paper's Tables 3, 4 and 15.

``mergekit-darts stats`` (and a sweep spec's ``compare:``) select two configurations from the
sweep's ``results.json``, run the tests of :mod:`mergekit_darts.analysis.stats` and write
``stats.md`` (the tables) and ``stats.json`` (the numbers) beside it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mergekit_darts.analysis.stats import (
    SEED,
    Correlation,
    PairedTest,
    compare_items,
    compare_seeds,
    config_label,
    group_test,
    parse_selector,
    rho_correlations,
    select,
)
from mergekit_darts.errors import ResultsError
from mergekit_darts.folder import fs
from mergekit_darts.present.document import markdown_table


def _f(x: float, digits: int = 3) -> str:
    return "nan" if isinstance(x, float) and math.isnan(x) else f"{x:.{digits}f}"


def paired_table(tests: Sequence[PairedTest]) -> str:
    """Shaped like the paper's Table 15."""
    return markdown_table(
        ["Task", "n", "Mean Diff", "t-stat", "t-test p-val", "W-stat", "Wilcoxon p-val", "note"],
        [
            [t.label, t.n, f"{t.mean_diff:+.2f}", _f(t.t), _f(t.t_p), _f(t.w), _f(t.w_p), t.note]
            for t in tests
        ],
    )


def seed_table(rows: Sequence[tuple[Any, float, float]], label_a: str, label_b: str) -> str:
    """Shaped like the paper's Table 4, with the group test below it."""
    body = [[seed, f"{x:.1f}", f"{y:.1f}"] for seed, x, y in rows]
    lines = [markdown_table(["Seed", f"{label_a} (Avg.)", f"{label_b} (Avg.)"], body)]
    if len(rows) >= 2:
        g = group_test([r[1] for r in rows], [r[2] for r in rows])
        lines.append(
            f"\nMean ± Std: a {g.mean_a:.1f} ± {g.std_a:.1f}, b {g.mean_b:.1f} ± {g.std_b:.1f}. "
            f"Shapiro-Wilk p: a {_f(g.shapiro_a_p)}, b {_f(g.shapiro_b_p)}. "
            f"Mann-Whitney U = {g.u:.1f}, p = {_f(g.u_p)}."
        )
    return "\n".join(lines)


def correlation_table(correlations: Sequence[Correlation]) -> str:
    return markdown_table(
        ["Task", "cells", "Pearson r", "p", "Spearman rho", "p"],
        [
            [c.label, c.n, _f(c.pearson_r), _f(c.pearson_p), _f(c.spearman_r), _f(c.spearman_p)]
            for c in correlations
        ],
    )


def rho_table(
    cells: Sequence[Mapping[str, Any]],
    baseline: Mapping[str, Any] | None,
    tasks: Sequence[str],
    label: str,
) -> str:
    """Shaped like the paper's Table 3: rho_L1 (%), score without and with surgery, change (pp)."""
    rows = []
    for task in tasks:
        rhos = [c["eval_rho"][task] for c in cells if c.get("eval_rho", {}).get(task) is not None]
        score = statistics.fmean(c["scores"][task] for c in cells)
        rho = f"{100 * statistics.fmean(rhos):.1f}" if rhos else "-"
        if baseline is None:
            rows.append([task, rho, "-", f"{score:.1f}", "-"])
        else:
            base = baseline["scores"][task]
            rows.append([task, rho, f"{base:.1f}", f"{score:.1f}", f"{score - base:+.1f}"])
    return markdown_table(["Task", "rho_L1 (%)", "No Surg.", label, "pp Change"], rows)


def compare_report(
    results: Mapping[str, Any], a: Mapping[str, str], b: Mapping[str, str], unit: str = SEED
) -> tuple[str, dict[str, Any]]:
    """Markdown and JSON of the a-vs-b comparison plus the rho_L1 analysis of a sweep."""
    tasks = results["tasks"]
    cells = [c for c in results["cells"] if c["settings"].get("surgery") != "none"]
    baseline = next((c for c in results["cells"] if c["settings"].get("surgery") == "none"), None)
    cells_a, cells_b = select(results["cells"], a), select(results["cells"], b)
    label_a, label_b = config_label(cells_a[0]["settings"]), config_label(cells_b[0]["settings"])
    parts = [f"# Statistics\n\na = `{label_a}`, b = `{label_b}`; Mean Diff = a − b.\n"]
    data: dict[str, Any] = {"a": label_a, "b": label_b, "unit": unit}
    if unit == SEED:
        tests, rows = compare_seeds(cells_a, cells_b, tasks)
        parts += ["## Per-seed average (Table 4)\n", seed_table(rows, "a", "b"), ""]
        data["seeds"] = [{"seed": s, "a": x, "b": y} for s, x, y in rows]
    elif unit == "item":
        tests = compare_items(cells_a, cells_b, tasks)
    else:
        raise ResultsError(f"unit must be 'seed' or 'item', got {unit!r}")
    parts += [f"## Paired tests over {unit}s (Table 15)\n", paired_table(tests), ""]
    data["paired"] = [asdict(t) for t in tests]
    parts += ["## rho_L1 and task score (Table 3)\n", rho_table(cells_a, baseline, tasks, "a"), ""]
    correlations = rho_correlations(cells, tasks)
    if correlations:
        parts += [
            f"Correlation of rho_L1 with score over all {len(cells)} surgery cells:\n",
            correlation_table(correlations),
            "",
        ]
    data["correlation"] = [asdict(c) for c in correlations]
    return "\n".join(parts), data


def load_results(results_dir: str | Path) -> dict[str, Any]:
    """The ``results.json`` a sweep wrote into its output folder."""
    path = Path(results_dir) / "results.json"
    if not path.is_file():
        raise ResultsError(f"no {path}: run `mergekit-darts sweep` first")
    return json.loads(path.read_text())


def write_stats(results_dir: str | Path, a: str, b: str, unit: str = SEED) -> tuple[str, Path]:
    """What ``mergekit-darts stats`` does: a vs b in a sweep's ``results.json``.

    ``a`` and ``b`` are selectors (``module=pos_corr,loss=ewl1``). Writes ``stats.md`` and
    ``stats.json`` beside the results; returns the markdown and the path of ``stats.md``.
    """
    results_dir = Path(results_dir)
    results = load_results(results_dir)
    try:
        markdown, data = compare_report(results, parse_selector(a), parse_selector(b), unit)
    except ResultsError:
        raise
    except ValueError as err:  # scipy's own refusals read as one line too
        raise ResultsError(str(err)) from err
    fs.write_text(results_dir / "stats.md", markdown + "\n")
    fs.write_text(results_dir / "stats.json", json.dumps(data, indent=2) + "\n")
    return markdown, results_dir / "stats.md"
