"""Every mistake a user can make ends each command with one ``Error:`` line, never a traceback.

What is raised is a ``DartsError`` subclass (``mergekit_darts.errors``); every command prints it
with ``error_line``: ``mergekit-yaml`` through the hook, ``mergekit-darts`` under click, and the
stock ``lm_eval`` (startup hook) or ``lm-eval-darts`` (hook off) around lm-eval's own command.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tiny
import yaml

from lm_eval_darts.model import DartsHFLM
from mergekit_darts.errors import DartsError, ModelArgsError, error_line

BIN = Path(sys.executable).parent
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
MC, MC_COPY, GEN = "darts_tiny_mc", "darts_tiny_mc_copy", "darts_tiny_gen"


@pytest.fixture(scope="module")
def merged(tiny_merged: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny merge with two surgery tasks: math serves darts_tiny_mc, code darts_tiny_mc_copy."""
    folder = Path(shutil.copytree(tiny_merged, tmp_path_factory.mktemp("one_line") / "merged"))
    modules = {
        name: tiny.random_module("pos_corr", 64, 4, 8, seed=i)
        for i, name in enumerate(["math", "code"])
    }
    entry = {"module": "pos_corr", "rank": 4, "max_positions": 8}
    tasks = {"math": {**entry, "eval_tasks": [MC]}, "code": {**entry, "eval_tasks": [MC_COPY]}}
    tiny.write_surgery_folder(folder / "surgery", modules, {"hidden_size": 64, "tasks": tasks})
    return folder


def test_error_line_is_one_line() -> None:
    err = ModelArgsError("surgery_map is empty;\n  e.g. surgery_map=gsm8k:math")
    assert error_line(err) == "Error: surgery_map is empty; e.g. surgery_map=gsm8k:math"


@pytest.mark.parametrize(
    ("model_args", "message"),
    [
        ({"surgery_map": MC}, f"bad surgery_map entry '{MC}': expected <lm-eval task>:<surgery"),
        ({"surgery": "math", "surgery_map": f"{MC}:math"}, "surgery_map applies to surgery=auto"),
        ({}, "holds surgery tasks math, code: choose surgery=<task>"),
        ({"surgery_map": f"{MC}:math;{MC}:code"}, f"surgery_map maps '{MC}' twice (math, code)"),
    ],
)
def test_hf_darts_model_argument_mistakes_are_darts_errors(
    merged: Path, tmp_path: Path, model_args: dict, message: str
) -> None:
    """Checked before the model loads (``pretrained`` here has no weights)."""
    with pytest.raises(DartsError) as info:
        DartsHFLM(pretrained=str(tmp_path), surgery_path=str(merged / "surgery"), **model_args)
    assert message in str(info.value)
    assert "\n" not in error_line(info.value)


@pytest.mark.slow
def test_surgery_auto_with_an_unlisted_task_is_a_darts_error(merged: Path) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    task_manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    with contextlib.chdir(TASKS_DIR), pytest.raises(DartsError) as info:
        simple_evaluate(
            model="hf-darts",
            model_args={"pretrained": str(merged), "surgery": "auto", "device": "cpu"},
            tasks=[MC, GEN],
            task_manager=task_manager,
            limit=1,
        )
    assert str(info.value).startswith(f"surgery=auto has no module for lm-eval task(s) {GEN}")


@pytest.mark.slow
def test_each_command_ends_a_mistake_with_one_line(tiny_family, merged: Path, tmp_path: Path):
    """One malformed value per command, all started together (lm_eval spends ~15 s on start)."""
    bad_block = {
        "steps": -1,
        "tasks": [{"name": "math", "target": str(tiny_family.math), "calibration": {"path": "x"}}],
    }
    recipe = tmp_path / "merge.yml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "models": [
                    {"model": str(tiny_family.math), "parameters": {"weight": 0.5}},
                    {"model": str(tiny_family.code), "parameters": {"weight": 0.5}},
                ],
                "dtype": "float32",
                "surgery": bad_block,
            }
        )
    )
    block = tmp_path / "surgery.yml"
    block.write_text(yaml.safe_dump({"surgery": bad_block}))
    (tmp_path / "a_file").write_text("")
    lm_eval = ["--tasks", GEN, "--include_path", ".", "--device", "cpu", "--limit", "1"]
    steps = "Error: surgery.steps: must be > 0 (got -1)"
    runs = {
        "mergekit-yaml": ([recipe, tmp_path / "out"], steps),
        "export": (["export", merged, tmp_path / "dest", "--task", "maths"], "Error: no surgery"),
        "report": (["report", merged, "--output", tmp_path / "a_file" / "r"], "Error: cannot"),
        "calibrate": (["calibrate", merged, block], steps),
        "lm_eval": (
            ["--model", "hf-darts", "--model_args", f"pretrained={merged},surgery_map={GEN}"]
            + lm_eval,
            f"Error: bad surgery_map entry '{GEN}'",
        ),
        "lm-eval-darts": (  # refused while evaluating: no module lists darts_tiny_gen
            ["--model", "hf-darts", "--model_args", f"pretrained={merged},surgery=auto"] + lm_eval,
            f"Error: surgery=auto has no module for lm-eval task(s) {GEN}",
        ),
    }
    env = {k: v for k, v in os.environ.items() if k != "DARTS_NO_HOOK"} | {"OMP_NUM_THREADS": "1"}
    procs = {
        name: subprocess.Popen(
            [
                str(
                    BIN
                    / (
                        name
                        if name in ("mergekit-yaml", "lm_eval", "lm-eval-darts")
                        else "mergekit-darts"
                    )
                ),
                *map(str, args),
            ],
            cwd=TASKS_DIR,
            env=env | ({"DARTS_NO_HOOK": "1"} if name == "lm-eval-darts" else {}),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (args, _) in runs.items()
    }
    try:
        stderr = {name: proc.communicate(timeout=600)[1] for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()  # only matters after a timeout
    for name, (_, start) in runs.items():
        shown = stderr[name][-3000:]
        assert procs[name].returncode == 1, (name, shown)
        assert "Traceback" not in stderr[name], (name, shown)
        errors = [line for line in stderr[name].splitlines() if line.startswith("Error")]
        assert len(errors) == 1 and errors[0].startswith(start), (name, shown)
        assert stderr[name].rstrip("\n").splitlines()[-1] == errors[0], (name, shown)
    assert not (tmp_path / "out").exists() and not (tmp_path / "dest").exists()
