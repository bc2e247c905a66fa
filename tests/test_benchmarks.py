"""Smoke test of the benchmarks at a minuscule size: structure and sane ratios, no timing asserts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.runner import run_all
from benchmarks.settings import tiny_settings

pytestmark = pytest.mark.slow  # every test here trains, merges or starts a process


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    settings = tiny_settings(results=str(root / "results"), workdir=str(root / "work"))
    found = run_all(settings)
    return found, report.write(found, settings.results)


def test_every_section_reports(results):
    found, _ = results
    for section in ("machine", "settings", "calibration", "store", "inference", "startup"):
        assert section in found, section
    tasks = found["calibration"]["tasks"]
    assert set(tasks) == {"standard", "pos_corr"}
    for task in tasks.values():
        for key in ("load_merged_s", "load_target_s", "precompute_s", "train_s", "total_s"):
            assert task[key] >= 0, key
        assert task["params"] > 0 and task["file_bytes"] > 0 and task["cache_bytes"] > 0
        assert task["memory"]["peak_rss"] > 0
    assert tasks["pos_corr"]["params"] > tasks["standard"]["params"]
    end_to_end = found["calibration"]["end_to_end"]
    assert end_to_end["rounds"] == 3 and end_to_end["ratio"] > 0
    default, off = end_to_end["stages"]["default"], end_to_end["stages"]["select off"]
    assert {"select_fits_s", "select_verdict_s", "refit_s"} <= set(default) and "train_s" in off
    assert "select_fits_s" not in off
    heads = found["calibration"]["heads"]
    assert heads["tasks"] == 4 and heads["head_float32_bytes"] == 256 * 64 * 4
    assert {"target", "merged", "train"} <= set(heads["phases"])
    assert {r["axis"] for r in found["scaling"]["rows"]} == {"N", "T", "rank", "H"}
    store = found["store"]
    assert store["demo_block"]["loads"] == 4  # 15 tasks over 3 targets: the targets + the merge
    assert store["demo_block"]["one_per_task"] == 16
    assert store["grid"]["loads"] == 6  # 3 targets + 3 merges, not 3 x 2 cells x 4


def test_every_ratio_is_finite_and_positive(results):
    found, _ = results
    ratios = found["ratios"]
    expected = (
        "precompute / 2 bare forward passes",
        "training loop / bare Adam loop (pos_corr)",
        "peak memory / (largest model + cache) (standard)",
        "naive both-loaded peak / (largest model + cache)",
        "hf-darts / hf tokens/s, loglikelihood, H=64",
        "hf-darts / hf tokens/s, generate_until, H=64",
        "startup hook cost, ms (python -c pass)",
        "8-cell sweep capture + training / (one capture per model + 8 bare training loops)",
    )
    for name in expected:
        assert any(key.startswith(name) for key in ratios), name
    for name, entry in ratios.items():
        assert math.isfinite(entry["value"]) and entry["value"] > 0, (name, entry)
        assert entry["met"] in (True, False, None)
    for point in found["inference"]["points"]:
        for key in ("raw_forward_ratio", "raw_generate_ratio"):
            assert math.isfinite(point[key]) and point[key] > 0


def test_outputs_are_written(results):
    found, written = results
    data = json.loads(Path(written["json"]).read_text())
    assert data["ratios"].keys() == found["ratios"].keys()
    text = Path(written["markdown"]).read_text()
    assert "Ratios and costs vs targets" in text and "| Phase |" in text
    assert Path(written["plot"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_isolated_phase_runs_in_a_fresh_process():
    import os

    from benchmarks.measure import run_isolated

    assert run_isolated(os.getpid) != os.getpid()


def test_bare_adam_loop_takes_the_products_steps() -> None:
    """The floor the training loop is timed against runs the product's own steps (each batch
    cropped to its longest row, as train_surgery does): it ends at train_surgery's weights."""
    import torch

    from benchmarks.calibration import bare_adam_loop
    from mergekit_darts import build_module
    from mergekit_darts.calibrate.capture import Captured
    from mergekit_darts.calibrate.train import TrainSettings, train_surgery

    generator = torch.Generator().manual_seed(0)
    mask = torch.arange(5) < torch.tensor([5, 2, 3, 4, 2, 3]).unsqueeze(-1)  # right-padded
    merged = Captured(torch.randn(6, 5, 8, generator=generator), mask)
    entropy = torch.rand(6, 5, generator=generator)
    target = Captured(torch.randn(6, 5, 8, generator=generator), mask, entropy)
    ours = train_surgery(
        build_module("pos_corr", 8, 2, 5, seed=0),
        merged,
        target,
        TrainSettings(steps=7, batch_size=4, seed=3),
        progress=False,
    ).module
    bare = bare_adam_loop(build_module("pos_corr", 8, 2, 5, seed=0), merged, target, 7, 4, seed=3)
    for name, value in ours.state_dict().items():
        assert torch.equal(value, bare.state_dict()[name]), name
