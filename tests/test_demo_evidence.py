"""The demo's evidence tables: Spearman against a hand-written rank correlation, and the outcomes."""

from __future__ import annotations

import json

import pytest

from demo.domains import DOMAIN_NAMES
from demo.evidence import (
    NONE_LABEL,
    Point,
    correlations,
    pooled,
    selection_outcomes,
    verdict_outcomes,
)

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


def _verdict_points() -> list[Point]:
    """One merge, three domains; per-prompt completion match of none and two corrections over
    10 held-out prompts, and their exact match on the evaluation items."""
    none = [0] * 10
    clear = [1] * 7 + [0] * 3  # 7 better, 0 worse: p = 1/128, passes 0.05 / 2
    weak = [1] * 5 + [0] * 5  # 5 better, 0 worse: p = 1/32, fails 0.05 / 2
    worse = [0] * 10
    plan = {  # domain -> [(variant, per-prompt match, exact match)]
        "code": [(NONE_LABEL, none, 50), ("A", clear, 60), ("B", weak, 70)],
        "math": [(NONE_LABEL, none, 40), ("A", weak, 30), ("B", worse, 20)],
        "instruct": [(NONE_LABEL, none, 30), ("A", clear, 20), ("B", clear, 25)],
    }
    points = []
    for domain, rows in plan.items():
        for variant, match, em in rows:
            verdict = {
                "completion_match": [float(m) for m in match],
                "completion_agreement": [0.5] * 10,  # no prompt differs: nothing passes
                "completion_rho_l1": [0.0 if variant == NONE_LABEL else 0.1] * 10,  # all better
            }
            metrics = {f"verdict_{k}": sum(v) / 10 for k, v in verdict.items()}
            points.append(Point("m", "prompts", domain, variant, em, metrics, verdict=verdict))
    return points


def test_verdict_outcomes_keep_only_what_passes_the_sign_test():
    rows = {r["metric"]: r for r in verdict_outcomes(_verdict_points())}
    match = rows["completion_match"]
    # code: A passes (60 - 50); math: nothing passes (none kept, 0); instruct: A and B pass with
    # the same mean, the first (A) is kept (20 - 30)
    assert (match["cells"], match["kept_correction"], match["at_least_none"]) == (3, 2, 2)
    assert match["mean_delta"] == pytest.approx((10 + 0 - 10) / 3)
    assert (match["min_delta"], match["max_delta"]) == (-10, 10)
    agreement = rows["completion_agreement"]
    assert agreement["kept_correction"] == 0 and agreement["mean_delta"] == 0
    rho = rows["completion_rho_l1"]  # A and B better on all 10 prompts, equal means: A kept
    assert rho["kept_correction"] == 3
    assert rho["mean_delta"] == pytest.approx((10 - 10 - 10) / 3)


def test_pooled_reads_several_results_files(tmp_path):
    paths = []
    for run in range(2):
        path = tmp_path / f"results{run}.json"
        path.write_text(json.dumps({"held_out": [vars(p) for p in _verdict_points()]}))
        paths.append(path)
    text = pooled(paths)
    # each run's merge is its own cell: twice the cells of one run, same mean
    assert "| prompts | completion_match | 6 | 4 | 4 | +0.0 | -10.0 | +10.0 |" in text


def test_the_pooling_command_names_a_missing_results_file(tmp_path, capsys):
    from demo.evidence import main

    with pytest.raises(SystemExit) as stop:
        main([str(tmp_path / "runs" / "results.json")])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "no such results.json" in err and "--full" in err


@pytest.mark.parametrize("cross_fitted", [True, False])
def test_collect_reads_the_merges_own_numbers_with_folds_or_a_held_out_share(cross_fitted):
    """Cross-fitted select tasks have no held-out share: the `none` candidate's pooled numbers
    are the merge's; with a share, its "before" values are."""
    from types import SimpleNamespace

    from demo.configs import DARTS, VARIANTS, fixed_variant, surgery_task
    from demo.evidence import collect

    def numbers(agreement: float) -> dict:
        return {
            "agreement": agreement,
            "kl": 1 - agreement,
            "rho_l1": 0.3,
            "completion": {"agreement": agreement / 2},
        }

    tasks, scores = {}, {NONE_LABEL: dict.fromkeys(DOMAIN_NAMES, 5.0)}
    for variant in (v for v in VARIANTS if v.selects):
        fixed = [
            {**DARTS, **v.overrides}
            for v in VARIANTS
            if not v.selects and v.continuation_tokens == variant.continuation_tokens
        ][:2]
        candidates = [{"module": "none", "loss": "l1", "held_out": numbers(0.4)}]
        candidates += [{**c, "held_out": numbers(0.6)} for c in fixed]
        for c in candidates[1:]:
            scores[fixed_variant(c, variant.continuation_tokens).label] = dict.fromkeys(
                DOMAIN_NAMES, 7.0
            )
        share = (
            None
            if cross_fitted
            else {
                "all": {"agreement_before": 0.1, "kl_before": 0.9},
                "completion": {"agreement_before": 0.05},
            }
        )
        for domain in DOMAIN_NAMES:
            tasks[surgery_task(domain) + variant.suffix] = SimpleNamespace(
                held_out=share, selection={"candidates": candidates, "chosen": 1}
            )
    points = collect("m", SimpleNamespace(tasks=tasks), scores)
    merge = [p for p in points if p.variant == NONE_LABEL]
    assert merge and all(p.exact_match == 5.0 for p in merge)
    expected = (0.4, 0.6, 0.2) if cross_fitted else (0.1, 0.9, 0.05)
    for p in merge:
        got = (p.metrics["agreement"], p.metrics["kl"], p.metrics["completion_agreement"])
        assert got == pytest.approx(expected) and p.metrics["rho_l1"] == 0.0
    assert {p.metrics["agreement"] for p in points if p.variant != NONE_LABEL} == {0.6}


def _surgery_row(merge: str, label: str, delta: float):
    from demo.evaluation import Evaluation
    from demo.report import Row

    row = Row(merge, label, "surgery", Evaluation(dict.fromkeys(DOMAIN_NAMES, 0.0), {}))
    row.delta_vs_none = {"mean": delta, "ci95": [delta - 1, delta + 1]}
    return row


def test_plain_evidence_counts_plain_verdicts_and_the_share_of_the_best_module_gain():
    from demo.configs import DARTS_ROW, HEAD_ROW, HEADLINE, NORM_ROW, STANDARD_L1_ROW
    from demo.evidence import plain_evidence, plain_markdown

    deltas = {  # merge -> (Standard + L1, DARTS, head, norm)
        "a": (2.0, 4.0, 1.0, 3.0),  # best module DARTS +4, best plain norm +3: 75 %
        "b": (-1.0, -2.0, 0.5, -3.0),  # no module row gains: no share
    }
    rows = [
        _surgery_row(merge, variant.label, delta)
        for merge, values in deltas.items()
        for variant, delta in zip(
            (STANDARD_L1_ROW, DARTS_ROW, HEAD_ROW, NORM_ROW), values, strict=True
        )
    ]
    cells = [
        {"kept": [HEAD_ROW.label, "none", NORM_ROW.label]},
        {"kept": ["none", "none", "none"]},
        {"kept": [DARTS_ROW.label, HEAD_ROW.label, "none"]},
    ]
    evidence = plain_evidence(rows, HEADLINE, cells)
    assert (evidence["verdicts"], evidence["kept_plain"]) == (9, 3)
    assert (evidence["cells"], evidence["cells_kept_plain"]) == (3, 2)
    assert evidence["kept_by_label"][HEAD_ROW.label] == 2
    a, b = evidence["merges"]
    assert a["best_module"] == {"label": DARTS_ROW.label, "delta": 4.0}
    assert a["best_plain"] == {"label": NORM_ROW.label, "delta": 3.0}
    assert a["share_kept"] == pytest.approx(0.75)
    assert b["best_plain"]["label"] == HEAD_ROW.label and b["share_kept"] is None
    assert evidence["mean_share_kept"] == pytest.approx(0.75)
    text = plain_markdown(evidence)
    assert "kept head or norm in 3 of 9 verdicts" in text and "2 of 3 cells" in text
    assert f"| b | {STANDARD_L1_ROW.label}: -1.0 | {HEAD_ROW.label}: +0.5 | n/a (no gain) |" in text
    assert text.endswith("where a module row gains: 75 %.")
