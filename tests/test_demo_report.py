"""The demo's paired-bootstrap intervals, table and results.json rows (DESIGN "Demo results")."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from demo.configs import STANDARD_L1_ROW
from demo.domains import DOMAIN_NAMES
from demo.evaluation import Evaluation
from demo.report import (
    Row,
    add_deltas,
    add_long_deltas,
    long_table,
    markdown_table,
    regime,
    summary,
)
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


def test_the_joint_row_records_and_shows_what_its_verdict_kept() -> None:
    rows = _rows()
    joint = Row(
        "task_arithmetic", "joint", "surgery", rows[4].evaluation, joint_kept=["head", "none"]
    )
    rows.append(joint)
    add_deltas(rows)
    assert joint.record()["joint_kept"] == ["head", "none"]
    assert "joint_kept" not in rows[-2].record()
    line = markdown_table(rows).splitlines()[-1]
    assert line.endswith("| +0.0 [+0.0, +0.0] | kept head / none |")


def test_regime_reports_the_share_of_each_gain_kept() -> None:
    rows = _rows()
    numbers = regime(rows)
    base, none = rows[0].scores, rows[4].scores
    for d in DOMAIN_NAMES:
        expert = rows[1 + DOMAIN_NAMES.index(d)].scores[d]
        expected = (none[d] - base[d]) / (expert - base[d])
        assert numbers["gains_kept"]["task_arithmetic"][d] == pytest.approx(expected)


def _long_rows(n: int = 150) -> list[Row]:
    """A long-scale merge: no surgery (one run), Standard + L1 and DARTS over three surgery
    seeds; DARTS's per-token accuracy is Standard + L1's of the same seed plus 1/64 on every
    item (so the difference is exact only when seed s is paired with seed s), its exact match
    an independent draw."""
    rng = random.Random(9)

    def ev(items: dict[str, list[int]], tokens: dict[str, list[float]]) -> Evaluation:
        return Evaluation({d: 100 * statistics.fmean(v) for d, v in items.items()}, items, tokens)

    def draw(p: float) -> dict[str, list[int]]:
        return {d: _items(rng, p, n) for d in DOMAIN_NAMES}

    def shares() -> dict[str, list[float]]:
        return {d: [rng.randrange(63) / 64 for _ in range(n)] for d in DOMAIN_NAMES}

    none = ev(draw(0.3), shares())
    standard, darts = {}, {}
    for s in range(3):
        tokens = shares()
        standard[s] = ev(draw(0.4), tokens)
        darts[s] = ev(draw(0.5), {d: [x + 1 / 64 for x in v] for d, v in tokens.items()})
    group = "task_arithmetic"
    return [
        Row("Individual models", "Base", "base", ev(draw(0.1), shares())),
        Row(group, "None (merged)", "none", none),
        Row(group, STANDARD_L1_ROW.label, "surgery", standard[0], seeds=standard),
        Row(group, "DARTS (pos_corr + EWL1)", "surgery", darts[0], seeds=darts),
    ]


def _reference_diffs(a: Evaluation, b: Evaluation, tokens: bool) -> dict[str, list[float]]:
    """Per-item differences in points, float64, from the raw per-item lists."""
    values = (lambda e: e.tokens) if tokens else (lambda e: e.items)
    return {
        d: [100.0 * x - 100.0 * y for x, y in zip(values(a)[d], values(b)[d], strict=True)]
        for d in DOMAIN_NAMES
    }


def test_long_deltas_pair_seed_with_seed_against_standard_l1_and_every_seed_with_none() -> None:
    rows = _long_rows()
    add_deltas(rows)
    add_long_deltas(rows)
    _, none, standard, darts = rows
    # per-token accuracy vs Standard + L1: 100/64 points on every item of every seed, so a point
    vs_standard = darts.long_deltas["delta_token_accuracy_vs_standard_l1"]
    assert vs_standard["by_seed"] == {str(s): 100 / 64 for s in range(3)}
    assert (vs_standard["mean"], *vs_standard["ci95"]) == (100 / 64,) * 3
    assert vs_standard["direction"] == "better"
    for key, ref, tokens in [
        ("delta_vs_standard_l1", standard, False),
        ("delta_token_accuracy_vs_none", none, True),
    ]:
        diffs = {
            s: _reference_diffs(e, ref.seeds.get(s, ref.evaluation), tokens)
            for s, e in darts.seeds.items()
        }
        per_seed = {
            str(s): math.fsum(math.fsum(v) / len(v) for v in by.values()) / len(by)
            for s, by in diffs.items()
        }
        delta = darts.long_deltas[key]
        assert delta["by_seed"] == pytest.approx(per_seed, abs=1e-9), key
        assert delta["mean"] == pytest.approx(statistics.fmean(per_seed.values()), abs=1e-9)
        low, high = _reference_two_level(diffs, 2000, 11)
        assert delta["ci95"][0] == pytest.approx(low, abs=1.5), key
        assert delta["ci95"][1] == pytest.approx(high, abs=1.5), key
    # Standard + L1 is not compared with itself; the no-surgery comparison keeps its own
    assert set(standard.long_deltas) == {"delta_token_accuracy_vs_none"}
    assert standard.long_deltas["delta_token_accuracy_vs_none"]["by_seed"] == pytest.approx(
        {
            str(s): statistics.fmean(
                statistics.fmean(v) for v in _reference_diffs(e, none.evaluation, True).values()
            )
            for s, e in standard.seeds.items()
        },
        abs=1e-9,
    )


def test_the_long_table_shows_per_token_accuracy_and_the_deltas_vs_standard_l1() -> None:
    rows = _long_rows()
    add_deltas(rows)
    add_long_deltas(rows)
    lines = long_table(rows).splitlines()
    assert lines[0] == (
        "| Merge | Surgery | code tok | math tok | instruct tok | Avg. tok "
        "| Δ tok vs none [95% CI, items × 3 seeds] "
        f"| Δ vs {STANDARD_L1_ROW.label} [95% CI, items × 3 seeds] "
        f"| Δ tok vs {STANDARD_L1_ROW.label} [95% CI, items × 3 seeds] |"
    )
    base, none, standard, darts = ([c.strip() for c in x.strip("|").split("|")] for x in lines[2:])
    shown = {
        d: statistics.fmean(100 * statistics.fmean(e.tokens[d]) for e in rows[3].seeds.values())
        for d in DOMAIN_NAMES
    }
    assert darts[2:5] == [f"{shown[d]:.1f}" for d in DOMAIN_NAMES]
    assert darts[5] == f"{statistics.fmean(shown.values()):.1f}"
    assert darts[-1] == "+1.6 [+1.6, +1.6] *"
    assert standard[-2:] == ["", ""] and standard[-3] != ""  # no Δ against itself
    assert base[-3:] == none[-3:] == ["", "", ""]  # per-token accuracy only
    assert none[2] == f"{100 * statistics.fmean(rows[1].evaluation.tokens['code']):.1f}"
    text = summary(rows, regime(rows))
    assert (
        f"task_arithmetic / DARTS (pos_corr + EWL1): better than {STANDARD_L1_ROW.label} on "
        "per-token accuracy (95% CI over items and surgery seeds 0, 1, 2, and every seed's sign)"
    ) in text.splitlines()


def test_rows_without_per_token_accuracy_keep_their_records_and_summary() -> None:
    """The tiny and real scales measure no per-token accuracy: nothing new in results.json."""
    rows = _rows()
    add_deltas(rows)
    old = {"group", "label", "kind", "domain", "scores", "n_items", "rho_l1", "delta_vs_none"}
    assert all(set(row.record()) <= old for row in rows)
