"""The demo's evidence tables: Spearman against a hand-written rank correlation, and the outcomes."""

from __future__ import annotations

import pytest

from mergekit_darts.demo.domains import DOMAIN_NAMES
from mergekit_darts.demo.evidence import NONE_LABEL, Point, correlations, selection_outcomes

VARIANTS = ["A", "B", "C"]
# exact match and agreement per (domain, variant); KL is made to rank exactly like agreement
EM = {"code": [10, 30, 20, 5], "math": [0, 0, 0, 0], "instruct": [40, 20, 30, 10]}
AGREE = {
    "code": [0.5, 0.7, 0.6, 0.4],
    "math": [0.2, 0.3, 0.1, 0.0],
    "instruct": [0.6, 0.7, 0.5, 0.3],
}


def _points() -> list[Point]:
    points = []
    for domain in DOMAIN_NAMES:
        best = max(range(3), key=lambda i: AGREE[domain][i])
        for i, variant in enumerate([*VARIANTS, NONE_LABEL]):
            agree = AGREE[domain][i]
            metrics = {"agreement": agree, "kl": 1 - agree, "rho_l1": 0.0 if i == 3 else 0.5}
            points.append(
                Point("m", "prompts", domain, variant, EM[domain][i], metrics, chosen=i == best)
            )
    return points


def _ranks(values: list[float]) -> list[float]:
    order = sorted(values)
    return [sum(i for i, v in enumerate(order) if v == x) / order.count(x) for x in values]


def _spearman(xs: list[float], ys: list[float]) -> float:
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    return cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5


def test_correlations_match_a_hand_written_spearman():
    rows = {r["metric"]: r for r in correlations(_points())}
    xs = [a for d in DOMAIN_NAMES for a in AGREE[d]]
    ys = [e for d in DOMAIN_NAMES for e in EM[d]]
    assert rows["agreement"]["pooled"] == pytest.approx(_spearman(xs, ys))
    assert rows["kl"]["pooled"] == pytest.approx(rows["agreement"]["pooled"])  # KL negated
    within = [_spearman(AGREE[d], EM[d]) for d in ("code", "instruct")]  # math: EM constant
    assert rows["agreement"]["within_mean"] == pytest.approx(sum(within) / 2)
    assert rows["agreement"]["within_cells"] == 2 and rows["agreement"]["points"] == 12


def test_outcomes_compare_selection_with_fixed_variants_and_the_oracle():
    (outcome,) = selection_outcomes(
        _points(), {("m", "prompts"): {"code": 30, "math": 0, "instruct": 20}}
    )
    assert outcome["select"] == pytest.approx(50 / 3)
    # by agreement: code B (30), math B (0), instruct B (20)
    assert outcome["by_metric"]["agreement"] == pytest.approx(50 / 3)
    assert outcome["best_fixed_label"] == "A" and outcome["best_fixed"] == pytest.approx(50 / 3)
    assert outcome["oracle"] == pytest.approx(70 / 3)
    assert outcome["kept"] == {"code": "B", "math": "B", "instruct": "B"}
