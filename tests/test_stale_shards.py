"""A merged folder that also holds an earlier merge's weights: mergekit never deletes old shards.

Merging into ``out/`` with ``--out-shard-size`` and then again without it (or the other way
round) leaves ``model.safetensors`` beside ``model-0000k-of-0000n.safetensors`` and their index.
transformers loads ``model.safetensors`` from such a folder, and so do calibration, ``hf-darts``
and ``apply_surgery``; the export and the weights identity must follow the same file. Merges
here are the stock ``mergekit-yaml`` console script.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from test_identity import write_surgery
from test_merge_step import BIN, env
from transformers import AutoModelForCausalLM

from mergekit_darts import apply_surgery, load_surgery
from mergekit_darts.deploy.export import export
from mergekit_darts.identity import weights_identity

SHARD_SIZE = "100K"  # the tiny model's 360 KB of weights in four shards


def mergekit_yaml(tiny_family: Any, tmp_path: Path, out: Path, math: float, sharded: bool) -> None:
    recipe = {
        "merge_method": "task_arithmetic",
        "base_model": str(tiny_family.base),
        "models": [
            {"model": str(tiny_family.math), "parameters": {"weight": math}},
            {"model": str(tiny_family.code), "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
    }
    path = tmp_path / f"merge-{math}.yml"
    path.write_text(yaml.safe_dump(recipe))
    command = [str(BIN / "mergekit-yaml"), str(path), str(out)]
    if sharded:
        command += ["--out-shard-size", SHARD_SIZE]
    done = subprocess.run(command, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.to(torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("sharded_first", [True, False], ids=["stale-shards", "stale-single"])
def test_export_and_identity_follow_the_file_transformers_loads(
    tiny_family: Any, tmp_path: Path, sharded_first: bool
) -> None:
    out = tmp_path / "out"
    mergekit_yaml(tiny_family, tmp_path, out, math=0.5, sharded=sharded_first)
    mergekit_yaml(tiny_family, tmp_path, out, math=0.2, sharded=not sharded_first)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert (out / "model.safetensors").is_file() and len(shards) > 1
    write_surgery(out, weights_identity(out))

    # the identity is that of the folder without the files transformers does not read
    clean = Path(shutil.copytree(out, tmp_path / "clean"))
    for name in [*shards, "model.safetensors.index.json"]:
        (clean / name).unlink()
    assert weights_identity(out) == weights_identity(clean)
    load_surgery(clean / "surgery")  # the surgery belongs to those weights

    export(out, tmp_path / "dest", "math")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(
        tmp_path / "dest", trust_remote_code=True, dtype=torch.float32
    ).eval()
    state = exported.state_dict()
    for name, tensor in merged.state_dict().items():  # the very weights transformers loads
        assert torch.equal(state[name], tensor), name

    ids = torch.tensor([[2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])
    apply_surgery(merged, out / "surgery", "math")
    expected = logits(merged, ids)
    assert (logits(exported, ids) - expected).abs().max() <= 1e-5
