"""A surgery is stamped with the weights it was trained on, never with those found at the end.

``merged_identity`` is taken before anything is captured; when the folder's weights differ at
write time (a second merge into the same ``out/`` while the first calibrates), the run stops
with one line and writes nothing. Two ``mergekit-yaml`` runs into one folder: the one whose
weights were replaced under it stops; one that finds a ``surgery/`` written meanwhile by the
other leaves it alone (it has no overwrite flag). Merges are real mergekit runs; the second run
is the stock ``mergekit-yaml`` console script, started while the first one trains.
"""

from __future__ import annotations

import json
import subprocess
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
from tiny import (
    BIN,
    ONE_TASK,
    hooked_merge,
    merge_family,
    merge_recipe,
    merge_yaml,
    one_task_block,
    script_env,
)

from mergekit_darts import load_surgery, run_surgery
from mergekit_darts.calibrate import pipeline
from mergekit_darts.errors import SurgeryRunError
from mergekit_darts.folder.identity import weights_identity

pytestmark = pytest.mark.slow  # every test here trains, merges or starts a process

CHANGED = "changed while calibrating"


def test_weights_replaced_during_training_are_refused_at_write_time(
    tiny_family, calibration_data, tmp_path
):
    out = merge_family(tiny_family, tmp_path / "merged")
    block = one_task_block(tiny_family, calibration_data)

    def remerge_while_training(phase: str) -> Any:
        if phase == "train":  # captured already: a second merge lands other weights
            merge_family(tiny_family, out, math_weight=0.3)
        return nullcontext()

    with pytest.raises(SurgeryRunError, match=CHANGED) as info:
        run_surgery(out, block, progress=False, on_phase=remerge_while_training)
    assert "\n" not in str(info.value) and "nothing was written" in str(info.value)
    assert not (out / "surgery").exists()


def second_run_during_training(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> tuple[Path, list]:
    """B: the stock ``mergekit-yaml`` of ``method`` with a 3-step block into ``tmp_path/out`` (paths
    relative to ``root``, a ``workdir``), run to its end when the first task of A (run in this
    process) starts training. Returns the folder and a list that then holds B's CompletedProcess."""
    monkeypatch.chdir(root)
    out = tmp_path / "out"
    (tmp_path / "b.yml").write_text(merge_yaml(method, {**ONE_TASK, "steps": 3}))
    command = [str(BIN / "mergekit-yaml"), str(tmp_path / "b.yml"), str(out)]
    done: list[subprocess.CompletedProcess] = []
    train_task = pipeline.train_task

    def interleaved(*args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(
                subprocess.run(
                    command, cwd=root, env=script_env(), capture_output=True, text=True, timeout=600
                )
            )
        return train_task(*args, **kwargs)

    monkeypatch.setattr(pipeline, "train_task", interleaved)
    return out, done


def test_two_mergekit_yaml_runs_into_one_folder(workdir, tmp_path, monkeypatch):
    """A (task_arithmetic) trains while B (linear, other weights) merges and calibrates into the
    same out/: B's surgery stays with B's weights, A stops with one line."""
    out, done = second_run_during_training(workdir, tmp_path, monkeypatch, "linear")
    with pytest.raises(SurgeryRunError, match=CHANGED) as info:
        hooked_merge(merge_recipe("task_arithmetic", ONE_TASK), out)
    assert done[0].returncode == 0, done[0].stderr[-3000:]
    assert "\n" not in str(info.value)
    manifest = json.loads((out / "surgery" / "manifest.json").read_text())
    assert manifest["tasks"]["math"]["steps"] == 3  # B's
    assert manifest["merged_identity"] == weights_identity(out)
    load_surgery(out / "surgery")


def test_a_surgery_written_meanwhile_is_not_replaced_without_the_flag(
    workdir,
    tmp_path,
    monkeypatch,
):
    """B merges the same weights as A and calibrates first: A, run without an overwrite flag,
    finds B's surgery/ at write time and leaves it."""
    out, done = second_run_during_training(workdir, tmp_path, monkeypatch, "task_arithmetic")
    with pytest.raises(SurgeryRunError, match="appeared while calibrating") as info:
        hooked_merge(merge_recipe("task_arithmetic", ONE_TASK), out)
    assert done[0].returncode == 0, done[0].stderr[-3000:]
    assert "\n" not in str(info.value)
    manifest = json.loads((out / "surgery" / "manifest.json").read_text())
    assert manifest["tasks"]["math"]["steps"] == 3  # B's, untouched
    assert sorted(p.name for p in out.glob("*surgery*")) == ["surgery"]
