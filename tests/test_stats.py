"""Significance tests and correlations agree with scipy (and a float64 t by hand) on one set of numbers."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from click.testing import CliRunner
from scipy import stats as sps

from mergekit_darts.analysis import stats
from mergekit_darts.cli.stats import command as stats_command

# Paper Table 4: per-seed averages of DARTS and Standard surgery over 6 seeds.
DARTS_AVG = [42.3, 42.2, 42.3, 43.3, 42.2, 43.0]
STANDARD_AVG = [37.6, 41.7, 40.4, 41.8, 41.2, 41.1]
# Paper Table 14 (DARTS per task, 6 seeds) and a made-up baseline for it.
SEEDS = [0, 7, 29, 71, 164, 190]
DARTS = {
    "humaneval": [25.0, 24.4, 25.0, 25.0, 25.0, 25.0],
    "gsm8k": [43.4, 45.0, 43.6, 45.0, 44.4, 45.0],
    "alpacaeval": [58.6, 57.3, 58.3, 59.9, 57.1, 59.0],
}
STANDARD = {
    "humaneval": [25.6, 24.4, 23.8, 25.0, 24.4, 25.6],
    "gsm8k": [41.7, 43.1, 42.9, 43.3, 42.0, 43.6],
    "alpacaeval": [57.0, 53.1, 55.2, 56.4, 54.0, 56.8],
}
TASKS = list(DARTS)


def hand_t(a: list[float], b: list[float]) -> float:
    """Paired t statistic in plain float64: mean(d) / (sd(d) / sqrt(n))."""
    d = [x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean = math.fsum(d) / n
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in d) / (n - 1))
    return mean / (sd / math.sqrt(n))


@pytest.mark.parametrize("task", TASKS)
def test_paired_test_matches_scipy_and_hand_t(task):
    a, b = DARTS[task], STANDARD[task]
    got = stats.paired_test(a, b, task)
    t, w = sps.ttest_rel(a, b), sps.wilcoxon(a, b)
    assert got.n == 6 and got.label == task
    assert got.mean_diff == pytest.approx(statistics.fmean(a) - statistics.fmean(b), abs=1e-12)
    assert got.t == pytest.approx(float(t.statistic), rel=1e-12)
    assert got.t_p == pytest.approx(float(t.pvalue), rel=1e-12)
    assert got.t == pytest.approx(hand_t(a, b), rel=1e-10)
    assert got.w == float(w.statistic) and got.w_p == pytest.approx(float(w.pvalue), rel=1e-12)


def test_identical_scores_give_nan_and_a_note():
    got = stats.paired_test([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert math.isnan(got.t) and math.isnan(got.w) and got.note == "a and b identical"


def test_equal_differences_hidden_by_float_noise_are_equal():
    a, b = [20 / 30 * 100, 21 / 30 * 100], [21 / 30 * 100, 22 / 30 * 100]  # both -3.33 points
    assert a[0] - b[0] != a[1] - b[1]  # float noise: ttest_rel would give |t| ~ 1e15
    got = stats.paired_test(a, b)
    assert got.t == -math.inf and got.t_p == 0.0 and got.note == "every difference equal"
    assert got.mean_diff == pytest.approx(-10 / 3) and got.w == 0.0


def test_paired_test_rejects_unpaired_or_single_values():
    with pytest.raises(ValueError, match="3 scores of a but 2 of b"):
        stats.paired_test([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="at least 2 pairs"):
        stats.paired_test([1], [2])


def test_group_test_reproduces_paper_table_4_u():
    got = stats.group_test(DARTS_AVG, STANDARD_AVG)
    u = sps.mannwhitneyu(DARTS_AVG, STANDARD_AVG, alternative="two-sided")
    assert got.u == 36.0 == float(u.statistic)  # the paper's U
    assert got.u_p == pytest.approx(float(u.pvalue), rel=1e-12)
    assert got.shapiro_a_p == pytest.approx(float(sps.shapiro(DARTS_AVG).pvalue), rel=1e-12)
    assert got.mean_a == pytest.approx(42.55) and got.std_a == pytest.approx(
        statistics.stdev(DARTS_AVG)
    )


def test_correlation_matches_scipy_and_is_nan_for_constant_input():
    rho = [0.082, 0.113, 0.429, 0.142, 0.143, 0.51]
    score = [1.2, 2.2, 9.1, 4.9, -3.3, 9.9]  # paper Table 3: rho_L1 and pp change
    got = stats.correlation(rho, score, "all")
    pr, sr = sps.pearsonr(rho, score), sps.spearmanr(rho, score)
    assert got.pearson_r == pytest.approx(float(pr.statistic), rel=1e-12)
    assert got.pearson_p == pytest.approx(float(pr.pvalue), rel=1e-12)
    assert got.spearman_r == pytest.approx(float(sr.statistic), rel=1e-12)
    assert got.spearman_p == pytest.approx(float(sr.pvalue), rel=1e-12)
    assert math.isnan(stats.correlation([1, 2, 3], [5, 5, 5]).pearson_r)
    with pytest.raises(ValueError, match="3\\+ paired values"):
        stats.correlation([1, 2], [3, 4])


def _cell(settings, scores, rho=None, items=None):
    return {
        "cell": ",".join(f"{k}={v}" for k, v in settings.items()),
        "settings": settings,
        "scores": scores,
        "items": items or {t: {} for t in scores},
        "rho_l1": {} if rho is None else {"all": rho},
        "eval_rho": {} if rho is None else dict.fromkeys(scores, rho),
    }


@pytest.fixture
def results():
    cells = [_cell({"surgery": "none"}, {t: 20.0 for t in TASKS})]
    for i, seed in enumerate(SEEDS):
        for module, table, rho in (("pos_corr", DARTS, 0.3), ("standard", STANDARD, 0.2)):
            scores = {t: table[t][i] for t in TASKS}
            items = {t: {str(d): float((d + i) % 2) for d in range(4)} for t in TASKS}
            cells.append(_cell({"module": module, "seed": seed}, scores, rho + 0.01 * i, items))
    return {"tasks": TASKS, "axes": ["module"], "cells": cells}


def test_compare_seeds_pairs_by_seed_and_adds_the_average(results):
    a = stats.select(results["cells"], {"module": "pos_corr"})
    b = stats.select(results["cells"], {"module": "standard"})
    tests, rows = stats.compare_seeds(a, b, TASKS)
    assert [t.label for t in tests] == [*TASKS, "avg"]
    assert tests[1].t == pytest.approx(float(sps.ttest_rel(DARTS["gsm8k"], STANDARD["gsm8k"])[0]))
    assert [r[0] for r in rows] == SEEDS
    assert rows[0][1] == pytest.approx(statistics.fmean(DARTS[t][0] for t in TASKS))


def test_baseline_without_seed_pairs_with_every_seed(results):
    a = stats.select(results["cells"], {"module": "pos_corr"})
    base = stats.select(results["cells"], {"surgery": "none"})
    tests, rows = stats.compare_seeds(a, base, TASKS)
    assert len(rows) == 6 and all(r[2] == 20.0 for r in rows)
    assert tests[0].mean_diff == pytest.approx(statistics.fmean(DARTS["humaneval"]) - 20.0)


def test_compare_items_pools_item_pairs_over_seeds(results):
    a = stats.select(results["cells"], {"module": "pos_corr"})
    b = stats.select(results["cells"], {"module": "standard"})
    tests = stats.compare_items(a, b, TASKS)
    assert all(t.n == 4 * 6 and t.note == "a and b identical" for t in tests)


def test_selector_errors_are_one_line(results):
    with pytest.raises(ValueError, match="bad selector 'module'"):
        stats.parse_selector("module")
    with pytest.raises(ValueError, match="no finished sweep cell matches module=add"):
        stats.select(results["cells"], {"module": "add"})
    with pytest.raises(ValueError, match="several configurations"):
        stats.select(results["cells"], {"seed": "0"})


def test_stats_command_writes_markdown_and_json(tmp_path, results):
    (tmp_path / "results.json").write_text(json.dumps(results))
    run = CliRunner().invoke(
        stats_command, [str(tmp_path), "--a", "module=pos_corr", "--b", "module=standard"]
    )
    assert run.exit_code == 0, run.output
    markdown = (tmp_path / "stats.md").read_text()
    for heading in ("Table 4", "Table 15", "Table 3"):
        assert heading in markdown
    assert "| gsm8k | 6 |" in markdown and "Mann-Whitney U" in markdown
    data = json.loads((tmp_path / "stats.json").read_text())
    want = sps.wilcoxon(DARTS["alpacaeval"], STANDARD["alpacaeval"])
    assert data["paired"][2]["w_p"] == pytest.approx(float(want.pvalue))
    assert len(data["correlation"]) == 3
    bad = CliRunner().invoke(stats_command, [str(tmp_path), "--a", "x=1", "--b", "y=2"])
    assert bad.exit_code == 1 and "no finished sweep cell matches x=1" in bad.output
