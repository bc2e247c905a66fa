"""Significance of surgery differences over seeds, and how rho_L1 tracks task score.

The paper's evidence for DARTS over standard surgery is statistical: paired t-tests and Wilcoxon
signed-rank tests per task across calibration seeds (Table 15), per-seed averages with a
Mann-Whitney U test (Table 4), and the relation between bias reduction and score (Table 3). With
small evaluation sets single runs differ by noise, so these tests are what a user needs to tell a
real gain from luck. Everything here is plain scipy on numbers a sweep wrote to ``results.json``
(see :mod:`mergekit_darts.sweep`); nothing loads a model.
"""

from __future__ import annotations

import json
import math
import statistics
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
from scipy import stats as sps

SEED = "seed"
DIFF_DIGITS = 9  # score differences below 1e-9 points are float noise


@dataclass(frozen=True)
class PairedTest:
    """Table 15 row: ``a - b`` over paired observations (seeds, or items)."""

    label: str
    n: int
    mean_diff: float
    t: float
    t_p: float
    w: float
    w_p: float
    note: str = ""


@dataclass(frozen=True)
class GroupTest:
    """Table 4 footer: per-seed averages of ``a`` and ``b`` compared as two groups."""

    n: int
    mean_a: float
    std_a: float
    mean_b: float
    std_b: float
    shapiro_a_p: float
    shapiro_b_p: float
    u: float
    u_p: float


@dataclass(frozen=True)
class Correlation:
    """Table 3 analysis: does a larger rho_L1 go with a higher task score across cells?"""

    label: str
    n: int
    pearson_r: float
    pearson_p: float
    spearman_r: float
    spearman_p: float


def _quiet(fn, *args, **kwargs):
    """scipy warns on constant or tiny inputs; the ``note`` / NaN results already say so."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def paired_test(a: Sequence[float], b: Sequence[float], label: str = "") -> PairedTest:
    """``scipy.stats.ttest_rel(a, b)`` and ``scipy.stats.wilcoxon`` of the differences ``a - b``.

    Scores are means of item scores (k / n), so equal differences can differ by float noise
    (``86.67 - 90`` vs ``83.33 - 86.67``), which would give t = 1e15 instead of scipy's answer
    for equal differences (t = ±inf). Differences are therefore rounded to 1e-9 first; equal ones
    are reported as such, and the rest is scipy unchanged.
    """
    if len(a) != len(b):
        raise ValueError(f"{label or 'paired test'}: {len(a)} scores of a but {len(b)} of b")
    if len(a) < 2:
        raise ValueError(f"{label or 'paired test'}: needs at least 2 pairs, got {len(a)}")
    diffs = [round(x - y, DIFF_DIGITS) for x, y in zip(a, b, strict=True)]
    mean = statistics.fmean(diffs)
    if len(set(diffs)) > 1:
        t = _quiet(sps.ttest_rel, a, b)
        t_stat, t_p, note = float(t.statistic), float(t.pvalue), ""
    elif mean == 0:
        t_stat, t_p, note = math.nan, math.nan, "a and b identical"
    else:  # what ttest_rel gives for exactly equal, nonzero differences
        t_stat, t_p, note = math.copysign(math.inf, mean), 0.0, "every difference equal"
    if mean == 0 and not any(diffs):
        w, w_p = math.nan, math.nan
    else:
        w_res = _quiet(sps.wilcoxon, diffs)
        w, w_p = float(w_res.statistic), float(w_res.pvalue)
    return PairedTest(label, len(a), mean, t_stat, t_p, w, w_p, note)


def group_test(a: Sequence[float], b: Sequence[float]) -> GroupTest:
    """Mann-Whitney U (two-sided) of two groups, with Shapiro-Wilk p for each, as in Table 4."""
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"group test needs 2+ values per group, got {len(a)} and {len(b)}")

    def shapiro_p(x: Sequence[float]) -> float:
        return float(_quiet(sps.shapiro, x).pvalue) if len(x) >= 3 else math.nan

    u = _quiet(sps.mannwhitneyu, a, b, alternative="two-sided")
    return GroupTest(
        min(len(a), len(b)),
        statistics.fmean(a),
        statistics.stdev(a),
        statistics.fmean(b),
        statistics.stdev(b),
        shapiro_p(a),
        shapiro_p(b),
        float(u.statistic),
        float(u.pvalue),
    )


def correlation(x: Sequence[float], y: Sequence[float], label: str = "") -> Correlation:
    """Pearson and Spearman correlation of ``x`` and ``y`` (NaN when either is constant)."""
    if len(x) != len(y) or len(x) < 3:
        raise ValueError(f"{label or 'correlation'}: needs 3+ paired values, got {len(x)}/{len(y)}")
    if len(set(x)) < 2 or len(set(y)) < 2:
        return Correlation(label, len(x), math.nan, math.nan, math.nan, math.nan)
    pr, sr = _quiet(sps.pearsonr, x, y), _quiet(sps.spearmanr, x, y)
    return Correlation(
        label, len(x), float(pr.statistic), float(pr.pvalue), float(sr.statistic), float(sr.pvalue)
    )


# --- selecting cells of a sweep -------------------------------------------------------------


def parse_selector(text: str) -> dict[str, str]:
    """``"module=pos_corr,loss=ewl1"`` -> {"module": "pos_corr", "loss": "ewl1"}."""
    selector: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not (sep and key and value):
            raise ValueError(f"bad selector {part!r}: expected key=value[,key=value...]")
        selector[key] = value
    if not selector:
        raise ValueError("empty selector: expected key=value[,key=value...], e.g. module=pos_corr")
    return selector


def select(cells: Sequence[Mapping[str, Any]], selector: Mapping[str, str]) -> list[Mapping]:
    """Cells whose settings match ``selector``; they must differ only in ``seed``."""
    chosen = [
        c
        for c in cells
        if all(str(c["settings"].get(k)) == v for k, v in selector.items() if k != "cell")
        and ("cell" not in selector or c["cell"] == selector["cell"])
    ]
    text = ",".join(f"{k}={v}" for k, v in selector.items())
    if not chosen:
        raise ValueError(f"no finished sweep cell matches {text}")
    configs = {config_label(c["settings"]) for c in chosen}
    if len(configs) > 1:
        raise ValueError(f"{text} matches several configurations ({'; '.join(sorted(configs))})")
    return chosen


def config_label(settings: Mapping[str, Any]) -> str:
    """A configuration's name: its settings except the seed."""
    return ",".join(f"{k}={v}" for k, v in settings.items() if k != SEED) or "default"


def _by_seed(cells: Sequence[Mapping[str, Any]]) -> dict[Any, Mapping[str, Any]]:
    return {c["settings"].get(SEED): c for c in cells}


def paired_cells(
    cells_a: Sequence[Mapping[str, Any]], cells_b: Sequence[Mapping[str, Any]]
) -> list[tuple[Any, Mapping[str, Any], Mapping[str, Any]]]:
    """(seed, cell of a, cell of b) for the seeds both ran; a seedless side (the no-surgery
    baseline) pairs with every seed of the other."""
    a, b = _by_seed(cells_a), _by_seed(cells_b)
    if list(a) == [None]:
        a = dict.fromkeys(b, a[None])
    if list(b) == [None]:
        b = dict.fromkeys(a, b[None])
    return [(seed, a[seed], b[seed]) for seed in a if seed in b]


def average(cell: Mapping[str, Any], tasks: Sequence[str]) -> float:
    return statistics.fmean(cell["scores"][t] for t in tasks)


def compare_seeds(
    cells_a: Sequence[Mapping[str, Any]],
    cells_b: Sequence[Mapping[str, Any]],
    tasks: Sequence[str],
) -> tuple[list[PairedTest], list[tuple[Any, float, float]]]:
    """Table 15 (per task, plus the average) and Table 4 rows (seed, avg a, avg b), seed-paired."""
    pairs = paired_cells(cells_a, cells_b)
    if len(pairs) < 2:
        seeds = [seed for seed, _, _ in pairs]
        raise ValueError(f"a and b share {len(pairs)} seed(s) {seeds}; paired tests need 2+")
    tests = [
        paired_test([x["scores"][t] for _, x, _ in pairs], [y["scores"][t] for _, _, y in pairs], t)
        for t in tasks
    ]
    rows = [(seed, average(x, tasks), average(y, tasks)) for seed, x, y in pairs]
    tests.append(paired_test([r[1] for r in rows], [r[2] for r in rows], "avg"))
    return tests, rows


def compare_items(
    cells_a: Sequence[Mapping[str, Any]],
    cells_b: Sequence[Mapping[str, Any]],
    tasks: Sequence[str],
) -> list[PairedTest]:
    """Per task, pair per-item scores of a and b on the same (seed, item), pooled over seeds.

    Useful when there are few seeds: a single seed already gives one pair per evaluated item.
    """
    tests = []
    for task in tasks:
        xs, ys = [], []
        for _, x, y in paired_cells(cells_a, cells_b):
            items_a, items_b = x["items"][task], y["items"][task]
            for doc in sorted(set(items_a) & set(items_b)):
                xs.append(items_a[doc])
                ys.append(items_b[doc])
        tests.append(paired_test(xs, ys, task))
    return tests


def rho_correlations(cells: Sequence[Mapping[str, Any]], tasks: Sequence[str]) -> list[Correlation]:
    """Per task over surgery cells: rho_L1 of the module serving the task vs the task's score."""
    out = []
    for task in tasks:
        pairs = [
            (c["eval_rho"][task], c["scores"][task])
            for c in cells
            if c.get("eval_rho", {}).get(task) is not None
        ]
        if len(pairs) >= 3:
            out.append(correlation([p[0] for p in pairs], [p[1] for p in pairs], task))
    return out


# --- tables ----------------------------------------------------------------------------------


def _f(x: float, digits: int = 3) -> str:
    return "nan" if isinstance(x, float) and math.isnan(x) else f"{x:.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def paired_table(tests: Sequence[PairedTest]) -> str:
    """Shaped like the paper's Table 15."""
    return table(
        ["Task", "n", "Mean Diff", "t-stat", "t-test p-val", "W-stat", "Wilcoxon p-val", "note"],
        [
            [t.label, t.n, f"{t.mean_diff:+.2f}", _f(t.t), _f(t.t_p), _f(t.w), _f(t.w_p), t.note]
            for t in tests
        ],
    )


def seed_table(rows: Sequence[tuple[Any, float, float]], label_a: str, label_b: str) -> str:
    """Shaped like the paper's Table 4, with the group test below it."""
    body = [[seed, f"{x:.1f}", f"{y:.1f}"] for seed, x, y in rows]
    lines = [table(["Seed", f"{label_a} (Avg.)", f"{label_b} (Avg.)"], body)]
    if len(rows) >= 2:
        g = group_test([r[1] for r in rows], [r[2] for r in rows])
        lines.append(
            f"\nMean ± Std: a {g.mean_a:.1f} ± {g.std_a:.1f}, b {g.mean_b:.1f} ± {g.std_b:.1f}. "
            f"Shapiro-Wilk p: a {_f(g.shapiro_a_p)}, b {_f(g.shapiro_b_p)}. "
            f"Mann-Whitney U = {g.u:.1f}, p = {_f(g.u_p)}."
        )
    return "\n".join(lines)


def correlation_table(correlations: Sequence[Correlation]) -> str:
    return table(
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
    return table(["Task", "rho_L1 (%)", "No Surg.", label, "pp Change"], rows)


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
        raise ValueError(f"unit must be 'seed' or 'item', got {unit!r}")
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
        raise click.ClickException(f"no {path}: run `mergekit-darts sweep` first")
    return json.loads(path.read_text())


@click.command("stats")
@click.argument("results_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--a", "a", required=True, help="Configuration a, e.g. module=pos_corr,loss=ewl1.")
@click.option("--b", "b", required=True, help="Configuration b, e.g. module=standard,loss=l1.")
@click.option(
    "--unit",
    type=click.Choice([SEED, "item"]),
    default=SEED,
    show_default=True,
    help="Pair seeds (paper Tables 4, 15) or individual evaluation items.",
)
def stats_command(results_dir: Path, a: str, b: str, unit: str) -> None:
    """Paired t / Wilcoxon tests of a vs b and the rho_L1-score correlation of a sweep."""
    try:
        markdown, data = compare_report(
            load_results(results_dir), parse_selector(a), parse_selector(b), unit
        )
    except ValueError as err:
        raise click.ClickException(str(err)) from err
    (results_dir / "stats.md").write_text(markdown + "\n")
    (results_dir / "stats.json").write_text(json.dumps(data, indent=2) + "\n")
    click.echo(markdown)
    click.echo(f"wrote {results_dir / 'stats.md'} and stats.json")
