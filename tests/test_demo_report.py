"""The demo's paired-bootstrap intervals, table and results.json rows (DESIGN "Demo results")."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from mergekit_darts.analysis.stats import paired_bootstrap
from mergekit_darts.demo.domains import DOMAIN_NAMES
from mergekit_darts.demo.evaluation import Evaluation
from mergekit_darts.demo.report import Row, add_deltas, markdown_table, regime


def _reference_bootstrap(
    diffs: dict[str, list[float]], n_boot: int, seed: int
) -> tuple[float, float]:
    """Hand-written float64 loop, its own RNG: the same estimator, independently computed."""
    rng = random.Random(seed)
    stats = []
    for _ in range(n_boot):
        means = []
        for values in diffs.values():
            draw = [values[rng.randrange(len(values))] for _ in values]
            means.append(math.fsum(draw) / len(draw))
        stats.append(math.fsum(means) / len(means))
    stats.sort()
    return stats[int(0.025 * n_boot)], stats[int(0.975 * n_boot) - 1]


def _items(rng: random.Random, p: float, n: int) -> list[int]:
    return [int(rng.random() < p) for _ in range(n)]


def test_bootstrap_matches_an_independent_reference_and_normal_theory() -> None:
    rng = random.Random(1)
    diffs = {
        d: [100.0 * (rng.random() < 0.3) - 100.0 * (rng.random() < 0.2) for _ in range(300)]
        for d in DOMAIN_NAMES
    }
    ci = paired_bootstrap(diffs, n_boot=4000, seed=0)
    low, high = _reference_bootstrap(diffs, 2000, 7)
    assert ci.mean == pytest.approx(statistics.fmean(statistics.fmean(v) for v in diffs.values()))
    # Monte-Carlo error of a 2000-4000 draw percentile: well under 0.5 points here
    assert ci.low == pytest.approx(low, abs=0.6)
    assert ci.high == pytest.approx(high, abs=0.6)
    # and the normal-theory interval of a mean of three independent means
    se = math.sqrt(sum(statistics.pvariance(v) / len(v) for v in diffs.values())) / 3
    assert ci.low == pytest.approx(ci.mean - 1.96 * se, abs=0.15 * 1.96 * se)
    assert ci.high == pytest.approx(ci.mean + 1.96 * se, abs=0.15 * 1.96 * se)
    assert paired_bootstrap(diffs, n_boot=4000, seed=0) == ci  # fixed seed: same interval


def test_bootstrap_of_constant_differences_is_a_point() -> None:
    ci = paired_bootstrap({"a": [2.0] * 10, "b": [4.0] * 5})
    assert (ci.mean, ci.low, ci.high) == (3.0, 3.0, 3.0)
    assert ci.significant


def _rows() -> list[Row]:
    rng = random.Random(0)

    def ev(p: dict[str, float]) -> Evaluation:
        items = {d: _items(rng, p[d], 300) for d in DOMAIN_NAMES}
        return Evaluation({d: 100 * sum(v) / len(v) for d, v in items.items()}, items)

    low = {d: 0.1 for d in DOMAIN_NAMES}
    none = ev({d: 0.4 for d in DOMAIN_NAMES})
    better = Evaluation(
        none.scores,
        {d: [1 if i % 5 == 0 else x for i, x in enumerate(v)] for d, v in none.items.items()},
    )
    better = Evaluation({d: 100 * sum(v) / len(v) for d, v in better.items.items()}, better.items)
    return [
        Row("Individual models", "Base", "base", ev(low)),
        *(
            Row("Individual models", f"Expert: {d}", "expert", ev({**low, d: 0.95}), d)
            for d in DOMAIN_NAMES
        ),
        Row("task_arithmetic", "None (merged)", "none", none),
        Row("task_arithmetic", "same", "surgery", none, rho={d: 0.5 for d in DOMAIN_NAMES}),
        Row("task_arithmetic", "better", "surgery", better, rho={d: 0.5 for d in DOMAIN_NAMES}),
    ]


def test_rows_follow_the_results_schema() -> None:
    rows = _rows()
    add_deltas(rows)
    records = json.loads(json.dumps([row.record() for row in rows]))
    for record in records:
        assert record["kind"] in {"base", "expert", "none", "surgery"}
        assert set(record["scores"]) == set(record["n_items"]) == set(DOMAIN_NAMES)
        assert all(n == 300 for n in record["n_items"].values())
        assert ("domain" in record) == (record["kind"] == "expert")
        assert ("delta_vs_none" in record) == (record["kind"] == "surgery")
    same, better = records[-2]["delta_vs_none"], records[-1]["delta_vs_none"]
    assert same == {"mean": 0.0, "ci95": [0.0, 0.0]}
    assert better["mean"] > 0 and better["ci95"][0] > 0  # significantly better
    table = markdown_table(rows).splitlines()
    assert table[-2].endswith("| +0.0 [+0.0, +0.0] | 0.500 |")
    assert table[-1].split("|")[-3].strip().endswith("*")


def test_regime_reports_the_share_of_each_gain_kept() -> None:
    rows = _rows()
    numbers = regime(rows)
    base, none = rows[0].scores, rows[4].scores
    for d in DOMAIN_NAMES:
        expert = rows[1 + DOMAIN_NAMES.index(d)].scores[d]
        expected = (none[d] - base[d]) / (expert - base[d])
        assert numbers["gains_kept"]["task_arithmetic"][d] == pytest.approx(expected)
