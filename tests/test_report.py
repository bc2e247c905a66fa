"""The surgery report renders every plot from a folder the real pipeline wrote."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from mergekit_darts.cli.report import command as report_command
from mergekit_darts.hosts.post_merge import run_surgery
from mergekit_darts.present import plots
from mergekit_darts.present.card import report_link_markdown
from mergekit_darts.present.report import (
    load_diagnostics,
    recompute,
    write_report,
)

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def surgery_folder(tiny_family, tiny_merged, tmp_path_factory):
    """A copy of the tiny task-arithmetic merge with two surgery tasks written by ``run_surgery``.

    ``math``: pos_corr + ewl1 (entropy stored, position bias); ``code``: standard + l1 on the
    target's completion only (no entropy stored, no position bias).
    """
    root = tmp_path_factory.mktemp("report")
    merged = shutil.copytree(tiny_merged, root / "merged")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": p}) + "\n" for p in tiny_family.prompts))
    calibration = {"path": str(calib), "num_samples": 8, "max_length": 16}
    block = {
        "select": "off",  # the paper's recipe: a trained module to report on
        "rank": 4,
        "max_positions": 16,
        "steps": 8,
        "lr": 1e-2,
        "batch_size": 4,
        "cache_dtype": "float32",
        "tasks": [
            {"name": "math", "target": str(tiny_family.math), "calibration": calibration},
            {
                "name": "code",
                "target": str(tiny_family.code),
                "module": "standard",
                "loss": "l1",
                "loss_positions": "completion",
                "calibration": {**calibration, "continuation_tokens": 3},
            },
        ],
    }
    run_surgery(merged, block, progress=False)
    return merged


def _is_png(path):
    return path.is_file() and path.read_bytes()[:8] == PNG


@pytest.mark.slow
def test_report_renders_every_plot_from_the_pipeline_output(surgery_folder):
    path = write_report(surgery_folder, progress=False)
    out = surgery_folder / "surgery" / "report"
    assert path == out / "report.md"
    expected = [
        "rho_l1.png",
        "loss_curves.png",
        "math_delta_heatmap.png",
        "math_delta_by_position.png",
        "math_entropy.png",
        "code_delta_heatmap.png",
        "code_delta_by_position.png",
        "code_entropy.png",  # the pipeline stores the target's entropy whatever the loss
    ]
    markdown, page = path.read_text(), (out / "report.html").read_text()
    for name in expected:
        assert _is_png(out / name), name
        assert f"]({name})" in markdown and f"src='{name}'" in page
    assert "| math | pos_corr | ewl1 |" in markdown and "| code | standard | l1 |" in markdown
    assert "Bias growth with position" in markdown
    manifest = json.loads((surgery_folder / "surgery" / "manifest.json").read_text())
    for entry in manifest["tasks"].values():  # the stored diagnostics agree with the manifest
        assert f"loss counted: {entry['metrics']['rho_l1']:.3f};" in markdown


@pytest.mark.slow
def test_recompute_reproduces_stored_diagnostics_and_adds_entropy(surgery_folder):
    from mergekit_darts.folder.artifacts import read_manifest

    surgery = surgery_folder / "surgery"
    manifest = read_manifest(surgery)
    fresh = recompute(surgery_folder, manifest, progress=False)
    for task, entry in manifest.tasks.items():
        stored = load_diagnostics(surgery, entry)
        np.testing.assert_array_equal(fresh[task].mask, stored.mask)
        np.testing.assert_array_equal(fresh[task].loss_mask, stored.loss_mask)
        np.testing.assert_allclose(fresh[task].delta_before, stored.delta_before, atol=1e-6)
        np.testing.assert_allclose(fresh[task].delta_after, stored.delta_after, atol=1e-6)
        assert fresh[task].entropy is not None and fresh[task].entropy.shape == stored.mask.shape
        np.testing.assert_allclose(fresh[task].entropy, stored.entropy, atol=1e-5)


@pytest.mark.slow
def test_report_command_recompute_writes_entropy_for_every_task(surgery_folder, tmp_path):
    run = CliRunner().invoke(
        report_command, [str(surgery_folder), "--recompute", "--quiet", "--output", str(tmp_path)]
    )
    assert run.exit_code == 0, run.output
    assert _is_png(tmp_path / "code_entropy.png") and _is_png(tmp_path / "math_entropy.png")
    assert "Diagnostics recomputed" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_report_without_diagnostics_says_how_to_get_them(surgery_folder, tmp_path):
    merged = tmp_path / "merged"
    shutil.copytree(surgery_folder, merged, symlinks=True)
    shutil.rmtree(merged / "surgery" / "diagnostics")
    markdown = write_report(merged, progress=False).read_text()
    assert markdown.count("No per-token diagnostics are stored") == 2
    assert _is_png(merged / "surgery" / "report" / "rho_l1.png")


def test_report_command_fails_in_one_line_without_surgery(tmp_path):
    run = CliRunner().invoke(report_command, [str(tmp_path)])
    assert run.exit_code == 1 and "no surgery manifest" in run.output


@pytest.mark.slow
def test_plot_functions_take_tensors_or_arrays(tmp_path):
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0, :6], mask[1, :4], mask[2, :2] = True, True, True
    before = torch.rand(3, 6, dtype=torch.bfloat16)
    plots.plot_delta_heatmap(before, before.float() / 2, mask, tmp_path / "h.png")
    plots.plot_delta_by_position(
        before.float().numpy(),
        before / 2,
        mask.numpy(),
        tmp_path / "p.png",
        bias_norm=plots.position_bias_norm(torch.ones(8, 4)),
    )
    plots.plot_entropy_by_position(before, mask, tmp_path / "e.png")
    plots.plot_loss_curves({"a": [1.0, 0.5], "b": [0.0, -1.0]}, tmp_path / "l.png", {"a": 5})
    plots.plot_rho({"a": 0.4, "b": -0.1}, tmp_path / "r.png")
    plots.plot_rho_vs_score({"t": [(0.1, 20.0), (0.3, 25.0)]}, tmp_path / "s.png")
    assert all(_is_png(tmp_path / f"{n}.png") for n in "hpelrs")
    means, counts = plots.position_mean([[1.0, 2.0], [3.0, 9.0]], [[1, 1], [1, 0]])
    assert means.tolist() == [2.0, 2.0] and counts.tolist() == [2, 1]
    with pytest.raises(ValueError, match="differ in shape"):
        plots.plot_entropy_by_position(torch.ones(2, 3), torch.ones(3, 2), tmp_path / "x.png")


@pytest.mark.slow
def test_report_link_points_at_the_report_from_the_card(surgery_folder):
    line = report_link_markdown("merged")
    assert "](surgery/report/report.md)" in line and "`mergekit-darts report merged`" in line
    write_report(surgery_folder, progress=False)
    assert (surgery_folder / "surgery/report/report.md").is_file()  # where the link points
