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
from test_sweep import spec_file  # noqa: F401  (a fixture)

from mergekit_darts.analysis import sweep
from mergekit_darts.deploy.export import export
from mergekit_darts.errors import ExportError, SurgeryConfigError


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def merged(tiny_merged: Path, tmp_path: Path) -> Path:
    folder = Path(shutil.copytree(tiny_merged, tmp_path / "merged"))
    module = tiny.random_module("pos_corr", 64, 4, 8, seed=1)
    entry = {"module": "pos_corr", "rank": 4, "max_positions": 8}
    tiny.write_surgery_folder(
        folder / "surgery", {"math": module}, {"hidden_size": 64, "tasks": {"math": entry}}
    )
    return folder


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
def test_a_sweep_output_inside_the_merged_folder_is_refused(spec_file, tmp_path, where):  # noqa: F811
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

    block = {
        "cache_dir": str(merged / "surgery" / "cache"),
        "tasks": [
            {
                "name": "math",
                "target": str(tiny_family.math),
                "calibration": {"path": str(calibration_data / "math.jsonl"), "field": "question"},
            }
        ],
    }
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
    import inspect

    import mergekit.merge
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    from mergekit_darts.integrations.mergekit_hook import merge_with_surgery

    target = Path(shutil.copytree(tiny_family.math, tmp_path / "math"))
    config = {
        "merge_method": "linear",
        "models": [
            {"model": str(tiny_family.base), "parameters": {"weight": 0.5}},
            {"model": str(target), "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
        "surgery": {
            "tasks": [
                {
                    "name": "math",
                    "target": str(target),
                    "calibration": {
                        "path": str(calibration_data / "math.jsonl"),
                        "field": "question",
                    },
                }
            ]
        },
    }
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(SurgeryConfigError) as info:
        merge_with_surgery(
            inspect.unwrap(mergekit.merge.run_merge),
            MergeConfiguration.model_validate(config),
            str(target),
            MergeOptions(quiet=True),
            yaml.safe_dump(config),
        )
    message = str(info.value)
    assert message.startswith(f"surgery.tasks[0].target: {target} is the merged folder")
    assert "\n" not in message
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
