"""Significance of surgery differences over seeds, and how rho_L1 tracks task score.

The paper's evidence for DARTS over standard surgery is statistical: paired t-tests and Wilcoxon
signed-rank tests per task across calibration seeds (Table 15), per-seed averages with a
Mann-Whitney U test (Table 4), and the relation between bias reduction and score (Table 3). With
small evaluation sets single runs differ by noise, so these tests are what a user needs to tell a
real gain from luck. Everything here is plain scipy on numbers a sweep wrote to ``results.json``
(see :mod:`mergekit_darts.analysis.sweep`); nothing loads a model. The paper-shaped tables of an
a-vs-b comparison are in :mod:`mergekit_darts.analysis.comparison`. A comparison that cannot be
made raises :class:`~mergekit_darts.errors.ResultsError` (a ``ValueError``).
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from scipy import stats as sps

from mergekit_darts.errors import ResultsError

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
        raise ResultsError(f"{label or 'paired test'}: {len(a)} scores of a but {len(b)} of b")
    if len(a) < 2:
        raise ResultsError(f"{label or 'paired test'}: needs at least 2 pairs, got {len(a)}")
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
        raise ResultsError(f"group test needs 2+ values per group, got {len(a)} and {len(b)}")

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
        raise ResultsError(
            f"{label or 'correlation'}: needs 3+ paired values, got {len(x)}/{len(y)}"
        )
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
            raise ResultsError(f"bad selector {part!r}: expected key=value[,key=value...]")
        selector[key] = value
    if not selector:
        raise ResultsError(
            "empty selector: expected key=value[,key=value...], e.g. module=pos_corr"
        )
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
        raise ResultsError(f"no finished sweep cell matches {text}")
    configs = {config_label(c["settings"]) for c in chosen}
    if len(configs) > 1:
        raise ResultsError(f"{text} matches several configurations ({'; '.join(sorted(configs))})")
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
        raise ResultsError(f"a and b share {len(pairs)} seed(s) {seeds}; paired tests need 2+")
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


@dataclass(frozen=True)
class BootstrapCI:
    """Mean paired difference and its percentile bootstrap interval (same units as the input)."""

    mean: float
    low: float
    high: float
    n: int
    n_boot: int
    seed: int

    @property
    def significant(self) -> bool:
        """True when the interval excludes zero."""
        return self.low > 0 or self.high < 0


def paired_bootstrap(
    diffs: Mapping[str, Sequence[float]],
    n_boot: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> BootstrapCI:
    """Mean over groups of the mean paired difference, CI by resampling items within each group.

    ``diffs`` maps a group (a domain) to per-item differences a - b on the same items. Resampling
    within groups keeps each domain's weight fixed, as the table's average does; a fixed ``seed``
    makes the interval reproducible. Percentile interval at ``level``.
    """
    import numpy as np

    if not diffs or any(len(d) == 0 for d in diffs.values()):
        raise ResultsError("paired_bootstrap needs at least one item in every group")
    rng = np.random.default_rng(seed)
    totals = np.zeros(n_boot, dtype=np.float64)
    point = 0.0
    for values in diffs.values():
        arr = np.asarray(values, dtype=np.float64)
        totals += arr[rng.integers(0, len(arr), size=(n_boot, len(arr)))].mean(axis=1)
        point += float(arr.mean())
    totals /= len(diffs)
    alpha = (1.0 - level) / 2
    low, high = np.quantile(totals, [alpha, 1.0 - alpha])
    n = sum(len(d) for d in diffs.values())
    return BootstrapCI(point / len(diffs), float(low), float(high), n, n_boot, seed)


@dataclass(frozen=True)
class SeededCI:
    """Mean paired difference over surgery seeds and items, with an interval that resamples both.

    ``per_seed`` holds each seed's own mean difference (the seed spread); ``direction`` is the
    row's call: ``better`` / ``worse`` only when the interval excludes zero *and* every seed's
    mean has that sign, otherwise ``no difference``.
    """

    mean: float
    low: float
    high: float
    per_seed: dict[int, float]
    n_items: int
    n_boot: int
    seed: int

    @property
    def direction(self) -> str:
        seeds = self.per_seed.values()
        if self.low > 0 and all(v > 0 for v in seeds):
            return "better"
        if self.high < 0 and all(v < 0 for v in seeds):
            return "worse"
        return "no difference"


def seeded_bootstrap(
    diffs: Mapping[int, Mapping[str, Sequence[float]]],
    n_boot: int = 10_000,
    seed: int = 0,
    level: float = 0.95,
) -> SeededCI:
    """Two-level paired bootstrap: resample surgery seeds, and items within each group.

    ``diffs[s][group]`` are per-item differences a - b of surgery seed ``s`` on the same items
    for every seed (the evaluation set is fixed, so items are paired across seeds too). Each
    resample draws as many seeds as there are, with replacement, and one resample of every
    group's items, shared by the drawn seeds; the statistic is the mean over groups of the mean
    over drawn seeds and items, as the point estimate is. The interval therefore covers training
    noise (seeds) and item noise together; with 3 seeds it can never be narrower than the seeds'
    own spread allows (each seed alone is drawn three times in 1/27 > 2.5 % of resamples).
    """
    import numpy as np

    seeds = list(diffs)
    if not seeds:
        raise ResultsError("seeded_bootstrap needs at least one seed")
    groups = list(diffs[seeds[0]])
    if not groups:
        raise ResultsError("seeded_bootstrap needs at least one group")
    for s in seeds:
        if list(diffs[s]) != groups:
            raise ResultsError(f"seed {s} has groups {list(diffs[s])}, seed {seeds[0]} {groups}")
        for g in groups:
            if len(diffs[s][g]) != len(diffs[seeds[0]][g]) or not diffs[s][g]:
                raise ResultsError(f"seed {s}, {g}: every seed needs the same, non-empty items")
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, len(seeds), size=(n_boot, len(seeds)))
    replicate = np.arange(n_boot)[:, None]
    totals = np.zeros(n_boot, dtype=np.float64)
    per_seed = np.zeros(len(seeds), dtype=np.float64)
    for g in groups:
        arr = np.asarray([diffs[s][g] for s in seeds], dtype=np.float64)  # seeds x items
        items = rng.integers(0, arr.shape[1], size=(n_boot, arr.shape[1]))
        resampled = np.stack([row[items].mean(axis=1) for row in arr])  # seeds x n_boot
        totals += resampled[drawn, replicate].mean(axis=1)
        per_seed += arr.mean(axis=1)
    totals /= len(groups)
    per_seed /= len(groups)
    alpha = (1.0 - level) / 2
    low, high = np.quantile(totals, [alpha, 1.0 - alpha])
    n = sum(len(v) for v in diffs[seeds[0]].values())
    return SeededCI(
        float(per_seed.mean()),
        float(low),
        float(high),
        {s: float(v) for s, v in zip(seeds, per_seed, strict=True)},
        n,
        n_boot,
        seed,
    )
