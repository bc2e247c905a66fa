"""Shared fixtures: a tiny local model family (no downloads)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models run many times faster on one thread than with thread hand-offs (results are the
# same); subprocesses (mergekit-yaml, lm_eval) inherit this through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers.dynamic_module_utils  # noqa: E402
from tiny import PROMPTS, build_tokenizer, save_model  # noqa: E402

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
    import json

    data = tiny_family.root / "data"
    data.mkdir(exist_ok=True)
    for name in ("math", "code"):
        lines = [json.dumps({"question": p}) for p in tiny_family.prompts]
        (data / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return data


@pytest.fixture(scope="session")
def tiny_merged(tiny_family: TinyFamily) -> Path:
    """A task-arithmetic merge of the tiny family made by the real, unwrapped mergekit."""
    import inspect

    import mergekit.merge
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    config = MergeConfiguration.model_validate(
        {
            "merge_method": "task_arithmetic",
            "base_model": str(tiny_family.base),
            "models": [
                {"model": str(tiny_family.math), "parameters": {"weight": 0.5}},
                {"model": str(tiny_family.code), "parameters": {"weight": 0.5}},
            ],
            "dtype": "float32",
        }
    )
    out = tiny_family.root / "merged"
    inspect.unwrap(mergekit.merge.run_merge)(config, str(out), MergeOptions(quiet=True))
    return out
