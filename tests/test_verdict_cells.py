"""The verdict's evidence cells: differences from no surgery per (merge, domain), what the
default kept, and the pooled safety and power numbers, against hand-computed values."""

from __future__ import annotations

import json
from math import comb

import numpy as np
import pytest

from demo.configs import DARTS, HEADLINE, NO_CORRECTION, STANDARD_L1
from demo.domains import DOMAIN_NAMES
from demo.evaluation import Evaluation
from demo.report import Row
from demo.verdict_cells import (
    BREAK_RATE_STEPS,
    NONE_KEPT,
    cells,
    exact_test_ceiling,
    judged,
    main,
    markdown,
)
from mergekit_darts.folder.manifest import Manifest, TaskEntry

N = 40
JUDGED = {"prompts": 50, "level": 0.05 / 3}
STD, DARTS_ROW, *_, SELECT_ROW = HEADLINE  # Standard + L1, DARTS, (plain rows), the default


def _evaluation(seed: int, rate: float) -> Evaluation:
    rng = np.random.default_rng(seed)
    items = {d: [int(x) for x in rng.random(N) < rate] for d in DOMAIN_NAMES}
    return Evaluation({d: 100 * sum(v) / N for d, v in items.items()}, items)


def _manifest(chosen: int) -> Manifest:
    """A manifest whose select tasks kept candidate `chosen` of (none, Standard + L1, DARTS)."""
    candidates = [NO_CORRECTION, STANDARD_L1, DARTS]
    tasks = {
        d + SELECT_ROW.suffix: TaskEntry(
            module="pos_corr",
            rank=4,
            max_positions=8,
            selection={
                "candidates": candidates,
                "chosen": chosen,
                "detectable": {"mean_gain": 0.5, "power": 0.8, **JUDGED},
            },
        )
        for d in DOMAIN_NAMES
    }
    return Manifest(hidden_size=4, tasks=tasks)


def _rows() -> list[Row]:
    none = _evaluation(0, 0.3)
    seeds = {
        STD.label: {0: _evaluation(1, 0.8), 1: _evaluation(2, 0.8)},  # clearly better
        DARTS_ROW.label: {0: _evaluation(3, 0.35), 1: _evaluation(4, 0.35)},
        SELECT_ROW.label: {0: _evaluation(1, 0.8), 1: none},  # kept Standard + L1 on seed 0
    }
    rows = [Row("ta", "None (merged)", "none", none)]
    rows += [Row("ta", label, "surgery", s[0], seeds=s) for label, s in seeds.items()]
    return rows


def test_cells_match_hand_computed_differences_and_say_what_was_kept() -> None:
    rows = _rows()
    records = cells(rows, [SELECT_ROW], {"ta": [_manifest(1), _manifest(0)]})
    assert [(c["merge"], c["calibration"], c["domain"]) for c in records] == [
        ("ta", "prompts", d) for d in DOMAIN_NAMES
    ]
    by_label = {r.label: r for r in rows}
    for cell in records:
        d = cell["domain"]
        none = np.asarray(by_label["None (merged)"].evaluation.items[d], dtype=np.float64)
        for label, record in [(SELECT_ROW.label, cell["default"]), *cell["fixed"].items()]:
            runs = by_label[label].seeds.values()
            expected = np.mean([100 * (np.asarray(e.items[d], np.float64) - none) for e in runs])
            assert record["mean"] == pytest.approx(expected, abs=1e-9)
            assert record["ci95"][0] <= record["mean"] <= record["ci95"][1]
        assert cell["best_fixed"]["label"] == STD.label
        assert cell["best_fixed"]["direction"] == "better"
        assert cell["kept"] == [STD.label, NONE_KEPT]
        assert cell["judged"] == JUDGED


def _cell(default: tuple[float, str], fixed: list[tuple[float, str]]) -> dict:
    return {
        "default": {"mean": default[0], "direction": default[1]},
        "fixed": {str(i): {"mean": m, "direction": d} for i, (m, d) in enumerate(fixed)},
        "judged": JUDGED,
    }


def test_judged_counts_unsafe_cells_and_averages_the_share_of_significant_gains() -> None:
    records = [
        _cell((10.0, "better"), [(20.0, "better"), (25.0, "no difference")]),  # 10 / 20
        _cell((0.0, "no difference"), [(8.0, "better"), (4.0, "better")]),  # 0 / 8
        _cell((-3.0, "worse"), [(1.0, "no difference")]),  # unsafe, no significant candidate
    ]
    total = judged(records)
    assert total["cells"] == 3
    assert total["default_below_none"] == 1
    assert total["cells_with_a_significant_candidate"] == 2
    assert total["mean_share_recovered"] == pytest.approx((10 / 20 + 0 / 8) / 2)
    ceilings = [exact_test_ceiling(g, JUDGED["prompts"], JUDGED["level"]) for g in (0.20, 0.08)]
    assert total["mean_exact_test_ceiling"] == pytest.approx(sum(ceilings) / 2)


def _reference_ceiling(gain: float, prompts: int, level: float) -> float:
    """Every (up, down) split of the prompts, its trinomial probability and the one-sided sign
    test's p-value (binomial tail at 1/2), in float64, over the same break rates."""
    best = 0.0
    for step in range(BREAK_RATE_STEPS + 1):
        down = step / BREAK_RATE_STEPS
        up = gain + down
        if up + down > 1:
            break
        power = 0.0
        for n_up in range(prompts + 1):
            for n_down in range(prompts - n_up + 1):
                moved = n_up + n_down
                p = sum(comb(moved, j) for j in range(n_up, moved + 1)) / 2**moved
                if moved and p <= level:
                    same = prompts - moved
                    ways = comb(prompts, n_up) * comb(prompts - n_up, n_down)
                    power += ways * up**n_up * down**n_down * (1 - up - down) ** same
        best = max(best, power)
    return best


@pytest.mark.parametrize(("gain", "prompts", "level"), [(0.1, 12, 0.05), (0.3, 10, 0.05 / 3)])
def test_exact_test_ceiling_matches_the_enumerated_sign_test(gain, prompts, level) -> None:
    assert exact_test_ceiling(gain, prompts, level) == pytest.approx(
        _reference_ceiling(gain, prompts, level), abs=1e-12
    )


def test_exact_test_ceiling_edges() -> None:
    assert exact_test_ceiling(1.0, 4, 0.05) == 0.0  # 2**-4 > 0.05: 4 prompts can never pass
    assert exact_test_ceiling(1.0, 5, 0.05) == pytest.approx(1.0)
    assert exact_test_ceiling(0.02, 50, 0.05) < exact_test_ceiling(0.2, 50, 0.05)
    with pytest.raises(ValueError, match="share"):
        exact_test_ceiling(0.0, 50, 0.05)


def test_markdown_and_cli_over_named_runs(tmp_path, capsys) -> None:
    records = cells(_rows(), [SELECT_ROW], {"ta": [_manifest(1), _manifest(0)]})
    text = markdown({"tiny": records})
    assert text.count("| tiny | ta | prompts |") == len(DOMAIN_NAMES)
    assert f"{STD.label} / {NONE_KEPT}" in text
    assert "significantly below no surgery: 0" in text
    assert "sees that gain at most" in text
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"verdict_cells": records}))
    main([f"tiny={path}"])
    assert capsys.readouterr().out.strip() == text
    with pytest.raises(SystemExit):
        main([str(path)])  # no FAMILY= name
    older = tmp_path / "older.json"
    older.write_text(json.dumps({"verdict_cells": [_without_judged(c) for c in records]}))
    with pytest.raises(SystemExit):
        main([f"tiny={older}"])  # written before cells recorded their judged prompts


def _without_judged(cell: dict) -> dict:
    return {k: v for k, v in cell.items() if k != "judged"}
