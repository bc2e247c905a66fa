"""The demo's paired-bootstrap intervals, table and results.json rows (DESIGN "Demo results")."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from demo.domains import DOMAIN_NAMES
from demo.evaluation import Evaluation
from demo.report import Row, add_deltas, markdown_table, regime
from mergekit_darts.analysis.stats import SeededCI, paired_bootstrap, seeded_bootstrap
from mergekit_darts.errors import ResultsError


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


def _reference_two_level(
    diffs: dict[int, dict[str, list[float]]], n_boot: int, seed: int
) -> tuple[float, float]:
    """Hand-written float64 loop, its own RNG: draw seeds with replacement, then items (shared
    by the drawn seeds) within each domain; mean over domains of the mean over seeds x items."""
    rng = random.Random(seed)
    seeds = list(diffs)
    stats = []
    for _ in range(n_boot):
        drawn = [seeds[rng.randrange(len(seeds))] for _ in seeds]
        means = []
        for d in diffs[seeds[0]]:
            n = len(diffs[seeds[0]][d])
            picks = [rng.randrange(n) for _ in range(n)]
            means.append(math.fsum(diffs[s][d][i] for s in drawn for i in picks) / (n * len(drawn)))
        stats.append(math.fsum(means) / len(means))
    stats.sort()
    return stats[int(0.025 * n_boot)], stats[int(0.975 * n_boot) - 1]


def _seed_diffs(shifts: list[float], n: int = 200) -> dict[int, dict[str, list[float]]]:
    """Per-item differences of three surgery seeds: the same item noise pattern, seed shifts."""
    rng = random.Random(3)
    out = {}
    for s, shift in enumerate(shifts):
        out[s] = {
            d: [
                100.0 * (rng.random() < 0.25 + shift) - 100.0 * (rng.random() < 0.25)
                for _ in range(n)
            ]
            for d in DOMAIN_NAMES
        }
    return out


def test_two_level_bootstrap_matches_an_independent_reference() -> None:
    diffs = _seed_diffs([0.0, 0.05, 0.10])
    ci = seeded_bootstrap(diffs, n_boot=4000, seed=0)
    per_seed = {
        s: statistics.fmean(statistics.fmean(v) for v in by_domain.values())
        for s, by_domain in diffs.items()
    }
    assert ci.per_seed == pytest.approx(per_seed)
    assert ci.mean == pytest.approx(statistics.fmean(per_seed.values()))
    low, high = _reference_two_level(diffs, 2000, 11)
    # Monte-Carlo error of the percentiles of a 27-component mixture: about 1 point here
    assert ci.low == pytest.approx(low, abs=1.5)
    assert ci.high == pytest.approx(high, abs=1.5)
    # seed noise widens the interval beyond the items-only one of the pooled items
    items_only = paired_bootstrap(
        {f"{d}{s}": diffs[s][d] for s in diffs for d in DOMAIN_NAMES}, n_boot=4000
    )
    assert ci.high - ci.low > 1.2 * (items_only.high - items_only.low)
    assert seeded_bootstrap(diffs, n_boot=4000, seed=0) == ci  # fixed seed: same interval


def test_two_level_bootstrap_of_constant_items_spans_the_seeds() -> None:
    """Exact: items constant within a seed leave only the seed draw; each seed alone is drawn
    three times in 1/27 > 2.5 % of resamples, so the interval is [min, max] of the seeds."""
    diffs = {s: {"a": [c] * 7, "b": [c] * 4} for s, c in enumerate([-1.0, 2.0, 5.0])}
    ci = seeded_bootstrap(diffs, n_boot=10_000, seed=0)
    assert (ci.mean, ci.low, ci.high) == (2.0, -1.0, 5.0)
    assert ci.per_seed == {0: -1.0, 1: 2.0, 2: 5.0}
    assert ci.direction == "no difference"


def test_one_seed_is_the_item_bootstrap() -> None:
    diffs = _seed_diffs([0.1])
    ci = seeded_bootstrap(diffs, n_boot=4000, seed=0)
    items = paired_bootstrap(diffs[0], n_boot=4000, seed=5)
    assert ci.mean == pytest.approx(items.mean)
    assert ci.low == pytest.approx(items.low, abs=0.6)
    assert ci.high == pytest.approx(items.high, abs=0.6)


def test_a_row_is_called_only_when_every_seed_agrees() -> None:
    def call(low: float, high: float, seeds: list[float]) -> str:
        return SeededCI(0.0, low, high, dict(enumerate(seeds)), 900, 10, 0).direction

    assert call(0.5, 3.0, [1.0, 2.0, 0.2]) == "better"
    assert call(0.5, 3.0, [1.0, 2.0, -0.2]) == "no difference"
    assert call(-3.0, -0.5, [-1.0, -2.0, -0.2]) == "worse"
    assert call(-3.0, 0.5, [-1.0, -2.0, -0.2]) == "no difference"


def test_two_level_bootstrap_refuses_unpaired_seeds() -> None:
    with pytest.raises(ResultsError, match="seed 1, a: every seed needs the same"):
        seeded_bootstrap({0: {"a": [1.0, 2.0]}, 1: {"a": [1.0]}})
    with pytest.raises(ResultsError, match="seed 1 has groups"):
        seeded_bootstrap({0: {"a": [1.0]}, 1: {"b": [1.0]}})


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
