"""``mergekit-multi`` (the real console script) with ``surgery:`` blocks in its stages.

Stock mergekit-multi calls ``run_merge`` without the raw YAML, so without our wrapper a block was
dropped silently. The intermediate folder is given as a bare relative ``-I inter``, which stock
mergekit's model card takes for the Hub id ``inter/<stage>`` (offline: a crash after merging).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny import surgery_block

from mergekit_darts.hosts.mergekit.multimerge import local_dir

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def block(target: str, steps: int = 5) -> dict:
    return surgery_block(
        f"./{target}",
        "data/math.jsonl",
        name=target,
        calibration={"max_length": 24},
        select="off",  # one trained module per stage
        steps=steps,
        batch_size=4,
    )


def recipe(final_steps: int = 5) -> str:
    stage = {
        "name": "stage1",
        "merge_method": "linear",
        "models": [
            {"model": "./math", "parameters": {"weight": 0.5}},
            {"model": "./code", "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
        "surgery": block("code"),
    }
    final = {
        "merge_method": "task_arithmetic",
        "base_model": "./base",
        "models": [{"model": "stage1", "parameters": {"weight": 0.7}}],
        "dtype": "float32",
        "surgery": block("math", final_steps),
    }
    return yaml.safe_dump_all([stage, final], sort_keys=False)


def multi(workdir: Path, name: str, text: str) -> subprocess.CompletedProcess:
    """``mergekit-multi <name>.yml -I <name>-inter --out-path <name>-out`` in ``workdir``."""
    (workdir / f"{name}.yml").write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "DARTS_NO_HOOK"}
    # this checkout's startup module (an installed copy of it may be older)
    path = os.pathsep.join([str(REPO), str(REPO / "startup"), env.get("PYTHONPATH", "")])
    env |= {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [str(BIN / "mergekit-multi"), f"{name}.yml", "-I", f"{name}-inter"]
    return subprocess.run(
        [*command, "--out-path", f"{name}-out"],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def merged(workdir) -> subprocess.CompletedProcess:
    return multi(workdir, "ok", recipe())


@pytest.mark.slow
def test_each_stage_runs_its_own_surgery(workdir, merged):
    assert merged.returncode == 0, merged.stderr[-3000:]
    for folder, task in ((workdir / "ok-inter" / "stage1", "code"), (workdir / "ok-out", "math")):
        manifest = json.loads((folder / "surgery" / "manifest.json").read_text())
        assert list(manifest["tasks"]) == [task]
        assert manifest["tasks"][task]["metrics"]["rho_l1"] > 0
        assert "## DARTS surgery" in (folder / "README.md").read_text()
    # the relative -I reached mergekit as ./ok-inter: its card names a local folder, no Hub link
    readme = (workdir / "ok-out" / "README.md").read_text()
    assert "./ok-inter/stage1" in readme and "huggingface.co/ok-inter" not in readme


@pytest.mark.slow
def test_lazy_rerun_skips_finished_stages_and_says_so(workdir, merged):
    assert merged.returncode == 0
    before = (workdir / "ok-out" / "surgery" / "math.safetensors").read_bytes()
    again = multi(workdir, "ok", recipe())
    assert again.returncode == 0, again.stderr[-3000:]
    assert "stage final merge and its surgery/ exist, both skipped" in again.stderr
    assert (workdir / "ok-out" / "surgery" / "math.safetensors").read_bytes() == before


@pytest.mark.slow
def test_bad_block_in_a_later_stage_stops_before_any_merge(workdir):
    done = multi(workdir, "bad", recipe(final_steps=0))
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: mergekit-multi stage final merge: surgery.steps: must be > 0")
    assert not (workdir / "bad-inter" / "stage1").exists() and not (workdir / "bad-out").exists()


def test_local_dir():
    assert local_dir("inter") == os.path.join(".", "inter")
    for path in ("./inter", "../inter", "/abs/inter", "~/inter", "a/b"):
        assert local_dir(path) == path
