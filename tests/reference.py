"""What the export tests share: the size of their random modules, an independent float64
reference of the correction, the checks they run on exported folders, and lm-eval requests of the
tasks in ``lm_eval_tasks/``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner
from lm_eval.api.instance import Instance
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from mergekit_darts.cli import main

RANK, MAX_POSITIONS = 4, 8  # the test prompts run past 8 tokens: positions off the table too
STEPS = 6
MC, MC_COPY, GEN, PPL = "darts_tiny_mc", "darts_tiny_mc_copy", "darts_tiny_gen", "darts_tiny_ppl"


def load(folder: Path, **kwargs: Any) -> Any:
    kwargs.setdefault("dtype", torch.float32)
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kwargs).eval()


# ---- an independent float64 reference -------------------------------------------------------------


def positions_by_hand(mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over each row's real tokens, -1 on padding, written out as loops."""
    out = torch.full(mask.shape, -1, dtype=torch.long)
    for row in range(mask.shape[0]):
        seen = 0
        for col in range(mask.shape[1]):
            if mask[row, col]:
                out[row, col] = seen
                seen += 1
    return out


def corrected64(kind: str, state: dict[str, torch.Tensor], h: torch.Tensor, pos: torch.Tensor):
    """h - correction(h, p) in float64, from the module kinds' formulas (paper 3.2, appendix E;
    the plain kinds' linear map and channel scale)."""
    w = {k.removeprefix("darts_surgery."): v.double() for k, v in state.items()}
    h = h.double()

    def bottleneck(x: torch.Tensor, down: str, up: str) -> torch.Tensor:
        return torch.relu(x @ w[down].T) @ w[up].T

    def rows(table: str) -> torch.Tensor:
        inside = ((pos >= 0) & (pos < MAX_POSITIONS)).unsqueeze(-1).double()
        return w[table][pos.clamp(0, MAX_POSITIONS - 1)] * inside

    if kind == "standard":
        delta = bottleneck(h, "down.weight", "up.weight")
    elif kind == "pos_corr":
        delta = bottleneck(h, "down.weight", "up.weight") + rows("position_bias")
    elif kind == "add":
        delta = bottleneck(h + rows("position_embedding"), "down.weight", "up.weight")
    elif kind == "head":  # h_hat = h - M h
        delta = torch.einsum("ij,btj->bti", w["weight"], h)
    elif kind == "norm":  # h_hat = s * h, stored as shift = 1 - s
        delta = h * w["shift"]
    else:
        delta = bottleneck(h, "down.weight", "up.weight") + bottleneck(
            rows("position_embedding"), "position_down.weight", "position_up.weight"
        )
    return h - delta


def head_input(model: Any, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain model's LM-head input and logits for ``inputs``."""
    seen: dict[str, torch.Tensor] = {}
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda _m, args: seen.update(h=args[0])
    )
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
    finally:
        hook.remove()
    return seen["h"], logits


# ---- exported folders --------------------------------------------------------------------------


NO_DARTS = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("mergekit_darts", "lm_eval_darts", "mergekit", "lm_eval"):
            raise ImportError(f"{name} is blocked: mergekit-darts must not be needed")
sys.meta_path.insert(0, Block())
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
inputs = load_file(sys.argv[1])
out = {}
for folder in sys.argv[3:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        out[folder] = model(**inputs).logits
assert not [m for m in sys.modules if m.startswith(("mergekit", "lm_eval"))]
save_file(out, sys.argv[2])
"""


def logits_without_darts(
    folders: list[str], batch: dict[str, torch.Tensor], tmp_path: Path
) -> dict[str, torch.Tensor]:
    """Each exported folder's logits on ``batch``, from a fresh interpreter that cannot import
    mergekit_darts, lm_eval_darts, mergekit or lm_eval (``NO_DARTS``)."""
    save_file(batch, tmp_path / "inputs.safetensors")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {
        "DARTS_NO_HOOK": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "HF_HUB_OFFLINE": "1",
    }
    done = subprocess.run(
        [sys.executable, "-c", NO_DARTS, str(tmp_path / "inputs.safetensors"),
         str(tmp_path / "logits.safetensors"), *folders],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(tmp_path / "logits.safetensors")


def load_offloaded(folder: Path, offload: Path, split: bool, **kwargs: Any) -> Any:
    """An exported folder under accelerate's offload, as a model larger than memory loads:
    ``split``, the embeddings and layer 0 on the CPU and the rest (head and surgery included) on
    disk; otherwise all of it on disk. Either way the surgery's tensors are on the meta device
    until accelerate's hooks bring them in."""
    whole = load(folder, **kwargs)
    size = {name: p.numel() * p.element_size() for name, p in whole.named_parameters()}
    layer = sum(v for k, v in size.items() if k.startswith("model.layers.0."))
    embed = size["model.embed_tokens.weight"]
    # accelerate keeps room for the largest offloaded layer: the embeddings and layer 0 fit
    budget = embed + 2 * layer if split else embed // 2
    model = load(
        folder, device_map="auto", max_memory={"cpu": budget}, offload_folder=str(offload), **kwargs
    )
    placed = model.hf_device_map
    if split:
        wanted = {"model.layers.0": "cpu", "lm_head": "disk", "darts_surgery": "disk"}
        assert {k: placed.get(k) for k in wanted} == wanted, placed
    else:
        assert placed == {"": "disk"}, placed
    assert all(p.is_meta for p in model.darts_surgery.parameters())
    return model


def unbind_surgery_file(folder: Path) -> None:
    """Drop the surgery file from config.json's darts.weights, as in an export made before it was
    recorded there: what the shipped loader checks inside the file is reached."""
    config = json.loads((folder / "config.json").read_text())
    del config["darts"]["weights"]["darts_surgery.safetensors"]
    (folder / "config.json").write_text(json.dumps(config))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def fail(*args: str) -> str:
    run = CliRunner().invoke(main, ["export", *args])
    assert run.exit_code != 0
    message = run.output.strip().splitlines()[-1]
    assert message.startswith("Error: "), run.output
    return message


BAD_SECTIONS = [
    ({"format": "other"}, "no 'darts-export' section"),
    ({"version": 2}, "version 2"),
    ({"base_model_type": "nonexistent"}, "base_model_type 'nonexistent'"),
    ({"base_model_type": "darts"}, "base_model_type 'darts'"),
    ({"base_architecture": None}, "no base_architecture"),
    ({"module": "bogus"}, "darts.module 'bogus'"),
    ({"rank": 0}, "positive integers"),
    ({"hidden_size": "64"}, "positive integers"),
    ({"prefix": ""}, "prefix"),
    ({"prefix": "other."}, "prefix 'other.'"),
]


# ---- lm-eval requests --------------------------------------------------------------------------


def instance(kind: str, args: tuple, task: str = MC, idx: int = 0) -> Instance:
    return Instance(request_type=kind, doc={}, arguments=args, idx=idx, metadata=(task, idx, 1))


def pos_corr_logits64(model: Any, module: Any, ids: torch.Tensor) -> torch.Tensor:
    """``h - c(h) - b_p`` then the LM head, in float64, for unpadded rows (positions 0..T-1);
    ``b_p`` is zero past the module's position table."""
    with torch.no_grad():
        h = model(input_ids=ids, output_hidden_states=True).hidden_states[-1].double()
    table = module.position_bias.detach().double()
    positions = torch.arange(ids.shape[-1])
    bias = table[positions.clamp(max=len(table) - 1)] * (positions < len(table)).double()[:, None]
    down, up = module.down.weight.detach().double(), module.up.weight.detach().double()
    h_hat = h - torch.relu(h @ down.T) @ up.T - bias
    return h_hat @ model.get_output_embeddings().weight.detach().double().T
