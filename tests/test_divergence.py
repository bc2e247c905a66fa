"""Diverged training and non-finite numbers never reach ``surgery/``.

Real ``run_surgery`` on the tiny family; the divergence verdict is checked against losses computed
here independently from the captured states.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import surgery_block

from mergekit_darts import run_surgery
from mergekit_darts.errors import SurgeryFormatError, SurgeryRunError


def _block(tiny_family, calibration_data, **task) -> dict:
    """The paper's recipe: one module, no selection."""
    return surgery_block(
        tiny_family.math,
        calibration_data / "math.jsonl",
        calibration={"max_length": 16},
        task=task,
        steps=10,
        batch_size=4,
        rank=4,
        max_positions=16,
        select="off",
    )


@pytest.fixture
def merged(merged_copy: Path) -> Path:
    return merged_copy


def _files(merged: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((merged / "surgery").rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("lr", "reason"),
    [(1e30, "its loss or weights became NaN or inf"), (1e12, "x the "), (1e3, "x the ")],
)
def test_diverged_training_stops_and_the_previous_surgery_stays(
    tiny_family, calibration_data, merged, lr, reason
):
    run_surgery(merged, _block(tiny_family, calibration_data), progress=False)
    good = _files(merged)
    with pytest.raises(SurgeryRunError) as caught:
        run_surgery(
            merged, _block(tiny_family, calibration_data, lr=lr), overwrite=True, progress=False
        )
    message = str(caught.value)
    assert message.startswith("surgery task 'math': training diverged (") and reason in message
    assert f"lower lr (now {lr:g}, default 1e-3)" in message and "\n" not in message
    assert _files(merged) == good


@pytest.mark.slow
def test_the_cli_exits_non_zero_with_one_line(tiny_family, calibration_data, merged, tmp_path):
    from click.testing import CliRunner

    from mergekit_darts.cli import main

    config = tmp_path / "surgery.yml"
    config.write_text(json.dumps(_block(tiny_family, calibration_data, lr=1e12)))
    run = CliRunner().invoke(main, ["calibrate", str(merged), str(config), "--quiet"])
    assert run.exit_code == 1 and "training diverged" in run.output
    assert not (merged / "surgery").exists()


@pytest.mark.slow
def test_divergence_compares_the_loss_over_every_training_token(
    tiny_family, calibration_data, merged
):
    """loss_start / loss_end against l1 computed here from the captures (the module is the identity at init)."""
    from mergekit_darts.calibrate.pipeline import capture_tasks, prepare_surgery
    from mergekit_darts.calibrate.train import DIVERGENCE_FACTOR, TrainSettings, train_surgery
    from mergekit_darts.correction.darts_correction import token_positions
    from mergekit_darts.correction.modules import build_module

    block = _block(tiny_family, calibration_data) | {"cache_dtype": "float32"}
    prepared = prepare_surgery(block, reference=str(merged), reference_label="m", out_path=merged)
    run = capture_tasks(merged, prepared, progress=False).runs[0]
    h, h_star, mask = run.merged.hidden, run.target.hidden, run.merged.mask
    expected_start = float((h - h_star).abs().mean(-1)[mask].mean())
    for lr, diverged in ((1e-3, False), (1e3, True)):
        module = build_module("pos_corr", h.shape[-1], 4, 16, seed=0)
        result = train_surgery(
            module, run.merged, run.target, TrainSettings("l1", 10, lr, 4), progress=False
        )
        assert result.loss_start == pytest.approx(expected_start, rel=1e-5)
        with torch.no_grad():
            h_hat = result.module(h, token_positions(mask))
        expected_end = float((h_hat - h_star).abs().mean(-1)[mask].mean())
        assert result.loss_end == pytest.approx(expected_end, rel=1e-5)
        assert (result.loss_end > DIVERGENCE_FACTOR * expected_start) is diverged
        assert (result.divergence() is not None) is diverged


@pytest.mark.slow
def test_a_diverging_select_candidate_is_left_out_and_recorded(
    tiny_family, calibration_data, merged, caplog
):
    candidates = [
        {"module": "pos_corr", "loss": "l1", "lr": 1e6},
        {"module": "pos_corr", "loss": "l1"},
    ]
    select = {"candidates": candidates, "holdout": 0.25, "metric": "rho_l1"}
    with caplog.at_level("WARNING", logger="mergekit_darts"):
        manifest = run_surgery(
            merged, _block(tiny_family, calibration_data, select=select), progress=False
        )
    selection = manifest["tasks"]["math"]["selection"]
    first, second = selection["candidates"]
    assert "diverged" in first and first["held_out"] == {
        "agreement": None,
        "kl": None,
        "rho_l1": None,
    }
    assert "diverged" not in second and selection["chosen"] == 1
    assert manifest["tasks"]["math"]["lr"] == 1e-3
    warned = [r.getMessage() for r in caplog.records if "diverged" in r.getMessage()]
    assert len(warned) == 1 and "left out of the choice" in warned[0]
    assert "| diverged |" in (merged / "README.md").read_text()

    every = [{"module": "pos_corr", "loss": "l1", "lr": lr} for lr in (1e6, 1e12)]
    block = _block(tiny_family, calibration_data, select={**select, "candidates": every})
    with pytest.raises(
        SurgeryRunError, match=r"diverged for every select candidate.*lower lr \(now 1e\+06, 1e\+12"
    ):
        run_surgery(merged, block, overwrite=True, progress=False)
    assert (
        manifest["tasks"]["math"]
        == json.loads((merged / "surgery" / "manifest.json").read_text())["tasks"]["math"]
    )


def test_non_finite_weights_or_numbers_are_never_written(tmp_path):
    from mergekit_darts.correction.modules import build_module
    from mergekit_darts.folder.artifacts import write_surgery_folder

    folder = tmp_path / "surgery"
    module = build_module("standard", 8, 2, 4)
    entry = {"module": "standard", "rank": 2, "max_positions": 4, "metrics": {"rho_l1": 0.5}}
    manifest = {"hidden_size": 8, "tasks": {"math": entry}}
    write_surgery_folder(folder, {"math": module}, manifest)
    before = _files(tmp_path)
    with torch.no_grad():
        bad = build_module("standard", 8, 2, 4)
        bad.up.weight[0, 0] = float("nan")
    with pytest.raises(
        SurgeryFormatError, match=r"'math': up.weight holds values that are not finite"
    ):
        write_surgery_folder(folder, {"math": bad}, manifest)
    curve = {**entry, "metrics": {"rho_l1": 0.5, "loss_curve": [1.0, float("inf")]}}
    with pytest.raises(
        SurgeryFormatError, match=r"manifest.tasks.math.metrics.loss_curve\[1\] is inf"
    ):
        write_surgery_folder(folder, {"math": module}, {**manifest, "tasks": {"math": curve}})
    assert _files(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["surgery"]
