"""Shared fixtures: a tiny local model family (no downloads), its merge, and the folders built
from them that several test modules use."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest.register_assert_rewrite("tiny", "reference")  # shared checks report as the tests do

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models run many times faster on one thread than with thread hand-offs (results are the
# same); subprocesses (mergekit-yaml, lm_eval) inherit this through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers.dynamic_module_utils  # noqa: E402
import yaml  # noqa: E402
from tiny import (  # noqa: E402
    EVAL_TASKS,
    PROMPTS,
    build_tokenizer,
    merge_family,
    save_model,
    surgery_block,
    tiny_config,
    write_choice_tasks,
)
from transformers import LlamaForCausalLM, T5Config  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def modules_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """transformers copies trust_remote_code modules here (not into ~/.cache). One folder for the
    whole session: transformers imports its ``transformers_modules`` package from the first one
    it is given, and a shipped file's relative import resolves through that package."""
    folder = tmp_path_factory.mktemp("hf_modules")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(folder))
        yield folder


@dataclass
class TinyFamily:
    base: Path
    math: Path
    code: Path
    root: Path
    prompts: list[str]


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory: pytest.TempPathFactory) -> TinyFamily:
    """A random base and two noisy 'fine-tunes' of it, each saved with the same tokenizer."""
    root = tmp_path_factory.mktemp("family")
    tokenizer = build_tokenizer()
    base = save_model(root / "base", tokenizer, seed=0)
    save_model(root / "math", tokenizer, seed=1, base=base, noise=0.3)
    save_model(root / "code", tokenizer, seed=2, base=base, noise=0.3)
    return TinyFamily(root / "base", root / "math", root / "code", root, list(PROMPTS))


# ---- merge-step fixtures (mergekit_darts.pipeline / hook / cli tests) -----------------------------


@pytest.fixture(scope="session")
def calibration_data(tiny_family: TinyFamily) -> Path:
    """``family/data/{math,code}.jsonl``: one ``{"question": ...}`` record per tiny prompt."""
    data = tiny_family.root / "data"
    data.mkdir(exist_ok=True)
    for name in ("math", "code"):
        lines = [json.dumps({"question": p}) for p in tiny_family.prompts]
        (data / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return data


@pytest.fixture(scope="session")
def tiny_merged(tiny_family: TinyFamily) -> Path:
    """A task-arithmetic merge of the tiny family made by the real, unwrapped mergekit."""
    return merge_family(tiny_family, tiny_family.root / "merged")


@pytest.fixture
def merged_copy(tiny_merged: Path, tmp_path: Path) -> Path:
    """A copy of ``tiny_merged`` this test may write into (``tmp_path/merged``)."""
    return Path(shutil.copytree(tiny_merged, tmp_path / "merged"))


@pytest.fixture(scope="module")
def workdir(
    tiny_family: TinyFamily, calibration_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A folder laid out like a user's: ./base ./math ./code ./data, YAML paths relative to it
    (``tiny.merge_recipe``), and ./broken, a model whose weights cannot be read."""
    root = tmp_path_factory.mktemp("work")
    for name in ("base", "math", "code"):
        (root / name).symlink_to(getattr(tiny_family, name))
    shutil.copytree(calibration_data, root / "data")
    broken = Path(shutil.copytree(tiny_family.code, root / "broken"))
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # config intact, weights unreadable
    return root


# ---- folders that must be refused ----------------------------------------------------------------


@pytest.fixture(scope="module")
def odd(tiny_family: TinyFamily, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Models and files that must be refused: other sizes, another tokenizer, broken data."""
    root = tmp_path_factory.mktemp("odd")
    tokenizer = build_tokenizer()
    save_model(root / "wide", tokenizer, seed=3, hidden_size=32)
    LlamaForCausalLM(tiny_config(len(tokenizer) + 8)).save_pretrained(root / "bigvocab")
    tokenizer.save_pretrained(root / "bigvocab")
    save_model(root / "othertok", tokenizer, seed=4)
    spec = json.loads((root / "othertok" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]
    (root / "othertok" / "tokenizer.json").write_text(json.dumps(spec))
    (root / "empty.jsonl").write_text("")
    (root / "blank.jsonl").write_text('{"text": "  "}\n{"text": ""}\n')
    (root / "nofield.jsonl").write_text('{"text": "one two"}\n{"prompt": "three"}\n')
    (root / "broken.jsonl").write_text('{"text": "one"}\n{"text": \n')
    (root / "prompts.csv").write_text("text\none two\n")
    # an encoder-decoder of the family's hidden size and tokenizer (a config is all preflight reads)
    T5Config(
        vocab_size=len(tokenizer), d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4
    ).save_pretrained(root / "t5")
    tokenizer.save_pretrained(root / "t5")
    return root


@pytest.fixture(scope="module")
def extended(tiny_family: TinyFamily, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The math expert with one token appended to its tokenizer and embedding rows."""
    root = tmp_path_factory.mktemp("extended")
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["[PAD]"])
    save_model(root / "math_plus", tokenizer, seed=5)  # vocab_size = len(tokenizer): one more
    swapped = root / "math_swapped"
    save_model(swapped, tokenizer, seed=6)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    return root


# ---- a sweep -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_file(
    tiny_family: TinyFamily, tiny_merged: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A sweep spec over a copy of the tiny merge: 8 cells of one task, scored on ``EVAL_TASKS``."""
    root = tmp_path_factory.mktemp("sweep")
    shutil.copytree(tiny_merged, root / "merged")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": p}) + "\n" for p in tiny_family.prompts))
    write_choice_tasks(root / "tasks")
    block = surgery_block(
        tiny_family.math,
        calib,
        field=None,
        calibration={"num_samples": 6, "max_length": 16},
        task={"eval_tasks": EVAL_TASKS},
        select="off",  # one trained module per cell
        rank=4,
        max_positions=16,
        steps=3,
        lr=1e-2,
        batch_size=4,
        cache_dtype="float32",
    )
    spec = {
        "merged": str(root / "merged"),
        "surgery": block,
        "output": str(root / "out"),
        "grid": {"module": ["standard", "pos_corr"], "loss": ["l1", "ewl1"], "seed": [0, 1]},
        "eval": {
            "tasks": EVAL_TASKS,
            "include_path": str(root / "tasks"),
            "include_defaults": False,
            "limit": 4,
            "batch_size": 4,
            "device": "cpu",
            "model_args": {"dtype": "float32"},
        },
        "compare": {"a": "module=pos_corr,loss=ewl1", "b": "module=standard,loss=l1"},
    }
    path = root / "sweep.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path
