"""Nothing is written into a merged folder by a command whose output goes elsewhere.

``export DEST`` inside the merged folder would be deleted by the next ``calibrate --overwrite``
(when under ``surgery/``) and would mix an export into the model folder; a sweep's ``output:`` is
the folder it writes cells and results to, and the merged folder is never written
(docs/analysis.md). Both are refused with one line before anything is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import tiny
import yaml

from mergekit_darts.analysis import sweep
from mergekit_darts.errors import ExportError, SurgeryConfigError
from mergekit_darts.hosts.deploy.export import export


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def merged(merged_copy: Path) -> Path:
    tiny.write_surgery(merged_copy / "surgery", tiny.random_modules({"math": "pos_corr"}, 64, 4, 8))
    return merged_copy


def test_an_export_inside_the_merged_folder_is_refused(merged, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(merged / "surgery")
    before = listing(merged)
    for dest in (merged / "surgery" / "x", merged / "exported", link / "x"):
        with pytest.raises(ExportError) as info:
            export(merged, dest, "math")
        message = str(info.value)
        assert message.startswith(f"{dest} is inside the merged folder {merged}"), message
        assert "\n" not in message and "choose a DEST outside it" in message
    assert listing(merged) == before
    export(merged, tmp_path / "outside", "math")  # beside it: fine


@pytest.mark.parametrize("where", [".", "surgery/sweep", "runs"])
def test_a_sweep_output_inside_the_merged_folder_is_refused(spec_file, tmp_path, where):
    spec = yaml.safe_load(spec_file.read_text())
    merged = Path(spec["merged"])
    spec["output"] = str(merged / where)
    spec["grid"] = {"seed": [0]}
    spec.pop("compare")
    path = tmp_path / "sweep.yml"
    path.write_text(yaml.safe_dump(spec))
    before = listing(merged)
    with pytest.raises(SurgeryConfigError) as info:
        sweep.run_spec_file(path)
    message = str(info.value)
    assert message.startswith(f"sweep.output: {merged / where} is inside the merged model folder")
    assert "\n" not in message
    assert listing(merged) == before


def test_a_capture_store_inside_surgery_is_refused(tiny_family, calibration_data, merged):
    """Every calibration replaces surgery/ whole: a cache_dir there would lose its captures."""
    from mergekit_darts import run_surgery

    block = tiny.surgery_block(
        tiny_family.math,
        calibration_data / "math.jsonl",
        cache_dir=str(merged / "surgery" / "cache"),
    )
    before = listing(merged)
    with pytest.raises(SurgeryConfigError) as info:
        run_surgery(merged, block, overwrite=True, progress=False)
    message = str(info.value)
    assert message.startswith(f"surgery.cache_dir: {merged / 'surgery' / 'cache'} is inside")
    assert "\n" not in message and "choose a folder outside it" in message
    assert listing(merged) == before


def test_a_merge_into_its_own_targets_folder_is_refused_before_merging(
    tiny_family, calibration_data, tmp_path
):
    """`mergekit-yaml cfg ./math` with a task targeting ./math would overwrite the fine-tune."""
    target = Path(shutil.copytree(tiny_family.math, tmp_path / "math"))
    config = {
        "merge_method": "linear",
        "models": [
            {"model": str(tiny_family.base), "parameters": {"weight": 0.5}},
            {"model": str(target), "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
        "surgery": tiny.surgery_block(target, calibration_data / "math.jsonl"),
    }
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(SurgeryConfigError) as info:
        tiny.hooked_merge(config, target)
    message = str(info.value)
    assert message.startswith(f"surgery.tasks[0].target: {target} is the merged folder")
    assert "\n" not in message
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
