"""Shared fixtures: a tiny local model family (no downloads)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny import PROMPTS, build_tokenizer, save_model  # noqa: E402


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
