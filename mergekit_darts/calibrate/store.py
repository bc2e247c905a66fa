"""The capture store: calibrate once, train many.

Captured hidden states depend only on the model (config, weights, tokenizer), the token
sequences, the cache dtype and how they were computed (capture batch size, device, library
versions); never on the module, loss, rank, learning rate, steps or seed. So they are kept under
a key of exactly those things (:func:`entry_key`): in memory for a run (a sweep's cells, the
tasks of one block) and, with ``cache_dir``, on disk as safetensors written under a temporary
name and renamed (:func:`mergekit_darts.folder.fs.atomic_file`), so a killed run never leaves half an
entry that looks whole. Each entry carries the sha256 of its tensors (:func:`tensors_sha256`) in
its one metadata value, so bytes changed under an intact header (bit rot, a foreign writer) are
caught too. An entry that fails any check on reading (header, checksum, shapes, a value that is
not finite) is recomputed and overwritten, never used. The disk store is optional: a write that
fails (a full disk) is one warning, and the run goes on with its captures in memory.

A model is keyed by :func:`mergekit_darts.folder.identity.cache_key` (the weight files its load reads,
by the identity's one rule, by their metadata; the rest by content). Which model is loaded when
is :mod:`mergekit_darts.calibrate.collect`'s job.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import itertools
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.correction.head import OutputHead
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.folder.fs import atomic_file
from mergekit_darts.folder.identity import cache_key

FORMAT = "darts-capture-store"
STORE_VERSION = 1
CAPTURES, COMPLETIONS = "captures", "completions"
LOG = logging.getLogger("mergekit_darts")


# ---- what determines a capture -------------------------------------------------------------------


def sequences_sha256(sequences: Sequence[Sequence[int]]) -> str:
    """sha256 of token id lists (one line of comma-separated ids each)."""
    text = "\n".join(",".join(map(str, seq)) for seq in sequences)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _versions() -> dict[str, str]:
    return {p: version(p) for p in ("torch", "transformers")}


def entry_key(kind: str, **parts: Any) -> str:
    """The key of an entry of ``kind`` (CAPTURES or COMPLETIONS) computed from ``parts``.

    Library versions are part of it: a new torch or transformers may compute other numbers.
    """
    head = {"kind": kind, "store": STORE_VERSION, **_versions()}
    text = json.dumps({**head, **parts}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


# ---- the store -----------------------------------------------------------------------------------


@dataclass
class StoreStats:
    """What a run took from the store and what it had to compute."""

    model_loads: int = 0
    computed: int = 0
    from_memory: int = 0
    from_disk: int = 0

    def since(self, earlier: StoreStats) -> dict[str, int]:
        """The counts of what happened after ``earlier`` (a copy taken then)."""
        return {k: getattr(self, k) - getattr(earlier, k) for k in vars(self)}


def check_cache_dir(cache_dir: str | Path | None) -> Path | None:
    """The store's folder (resolved from the working directory), checked writable.

    Called before any model is loaded, so a bad ``cache_dir`` costs no merge and no capture.
    Folders it makes for the check are removed again: the first entry written creates them, so
    a block refused by a later check leaves no empty ``cache_dir`` behind.
    """
    if not cache_dir:
        return None
    folder = Path(cache_dir).expanduser().resolve()
    made = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise SurgeryConfigError(
            f"surgery.cache_dir: cannot write the capture store to {folder} "
            f"({err.strerror or err}); choose a writable folder or remove the key"
        ) from None
    finally:
        for path in made:
            with contextlib.suppress(OSError):
                path.rmdir()
    return folder


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of tensors by name, dtype, shape and bytes: an entry's checksum.

    Computed from the tensors, not the file, so it can sit in the file's own header.
    """
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


def _finite(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether every floating-point tensor holds only finite values."""
    return all(bool(t.isfinite().all()) for t in tensors.values() if t.is_floating_point())


class CaptureStore:
    """Captures and prompt completions by key: in memory, and on disk under ``cache_dir``."""

    def __init__(self, cache_dir: str | Path | None = None) -> None:
        self.cache_dir = check_cache_dir(cache_dir)
        self.disk_failed: str | None = None  # why disk writes stopped (a full disk), if they did
        self._captures: dict[str, Captured] = {}
        self._completions: dict[str, list[list[int]]] = {}
        self._owner: dict[str, str] = {}  # key -> identity of the model it came from
        self.stats = StoreStats()

    # captures

    def get(
        self,
        key: str,
        lengths: Sequence[int],
        dtype: torch.dtype,
        device: str,
        needs: tuple[bool, bool] = (False, False),
        *,
        model: str,
    ) -> Captured | None:
        """The entry of ``key`` if it holds ``needs`` (entropy, head) and passes every check."""
        found = self._captures.get(key)
        if found is not None:
            if not _covers(found, *needs):
                return None
            self.stats.from_memory += 1
            return found
        tensors = self._read(CAPTURES, key, device)
        if tensors is None:
            return None
        try:
            found = _captured_from(tensors, lengths, dtype)
        except (KeyError, ValueError):
            self._discard(CAPTURES, key)
            return None
        if not _covers(found, *needs):
            return None
        self.stats.from_disk += 1
        self._captures[key] = found
        self._owner[key] = model
        return found

    def put(self, key: str, captured: Captured, *, model: str) -> None:
        """Keep ``captured`` (from the model of identity ``model``) in memory and on disk."""
        self._captures[key] = captured
        self._owner[key] = model
        if not model.startswith("hub:"):  # no files to tell a changed Hub model by
            tensors = {
                name: value.detach().cpu().contiguous()
                for name in ("hidden", "mask", "entropy")
                if (value := getattr(captured, name)) is not None
            }
            if captured.head is not None:
                tensors |= {k: v.cpu() for k, v in captured.head.tensors().items()}
            self._write(CAPTURES, key, tensors)

    # completions

    def get_completions(
        self, key: str, n: int, max_new: int, *, model: str
    ) -> list[list[int]] | None:
        if key in self._completions:
            self.stats.from_memory += 1
            return self._completions[key]
        tensors = self._read(COMPLETIONS, key, "cpu")
        if tensors is None:
            return None
        try:
            lengths, tokens = tensors["lengths"].tolist(), tensors["tokens"].tolist()
            if len(lengths) != n or sum(lengths) != len(tokens) or max(lengths) > max_new:
                raise ValueError("completions do not match their prompts")
        except (KeyError, ValueError):
            self._discard(COMPLETIONS, key)
            return None
        starts = [0, *itertools.accumulate(lengths)]
        found = [tokens[a:b] for a, b in itertools.pairwise(starts)]
        self.stats.from_disk += 1
        self._completions[key] = found
        self._owner[key] = model
        return found

    def put_completions(self, key: str, completions: list[list[int]], *, model: str) -> None:
        self._completions[key] = completions
        self._owner[key] = model
        if not model.startswith("hub:"):
            flat = [t for c in completions for t in c]
            tensors = {
                "lengths": torch.tensor([len(c) for c in completions], dtype=torch.int64),
                "tokens": torch.tensor(flat or [0], dtype=torch.int64)[: len(flat)],
            }
            self._write(COMPLETIONS, key, tensors)

    def forget(self, model: str) -> None:
        """Free the memory held by one model's entries (its disk entries stay)."""
        identity = cache_key(model)
        for key in [k for k, owner in self._owner.items() if owner == identity]:
            self._captures.pop(key, None)
            self._completions.pop(key, None)
            del self._owner[key]

    # disk

    def _path(self, kind: str, key: str) -> Path:
        return self.cache_dir / kind / f"{key}.safetensors"

    def _read(self, kind: str, key: str, device: str) -> dict[str, torch.Tensor] | None:
        if self.cache_dir is None or not self._path(kind, key).is_file():
            return None
        path = self._path(kind, key)
        try:
            with safe_open(path, framework="pt") as f:
                meta = json.loads((f.metadata() or {})[FORMAT])
            if meta.get("key") != key:
                raise ValueError("not this entry")
            tensors = load_file(path)  # on the CPU: checked before it goes anywhere
            if tensors_sha256(tensors) != meta.get("sha256"):
                raise ValueError("tensor bytes changed after the entry was written")
            if not _finite(tensors):
                raise ValueError("a value that is not finite")
            return {name: t.to(device) for name, t in tensors.items()}
        except Exception:  # truncated, corrupt, foreign: recompute, never use
            self._discard(kind, key)
            return None

    def _write(self, kind: str, key: str, tensors: dict[str, torch.Tensor]) -> None:
        if self.cache_dir is None or self.disk_failed is not None:
            return
        # One metadata value: safetensors orders several keys at random, and equal entries
        # should be equal bytes.
        meta = json.dumps({"key": key, "sha256": tensors_sha256(tensors)}, sort_keys=True)
        try:
            with atomic_file(self._path(kind, key)) as tmp:
                save_file(tensors, tmp, metadata={FORMAT: meta})
        except (OSError, SafetensorError) as err:  # the store is optional: go on without it
            reason = getattr(err, "strerror", None) or " ".join(str(err).split())[:200]
            self.disk_failed = f"cannot write to {self.cache_dir} ({reason})"
            LOG.warning(
                "capture store: %s; going on without the disk store for this run (captures "
                "stay in memory); free space or choose another cache_dir to keep them",
                self.disk_failed,
            )

    def _discard(self, kind: str, key: str) -> None:
        with contextlib.suppress(OSError):  # overwritten by the next write anyway
            self._path(kind, key).unlink(missing_ok=True)

    def disk_bytes(self) -> tuple[int, int]:
        """(entries, bytes) under ``cache_dir``."""
        if self.cache_dir is None:
            return 0, 0
        files = [p for kind in (CAPTURES, COMPLETIONS) for p in self.cache_dir.glob(f"{kind}/*")]
        files = [p for p in files if p.is_file() and not p.name.startswith(".")]
        return len(files), sum(p.stat().st_size for p in files)

    def summary(self) -> str:
        """One line: loads, captures computed / reused, and the disk store's size."""
        s = self.stats
        line = (
            f"capture store: {s.model_loads} model load{'s' * (s.model_loads != 1)}, "
            f"{s.computed} computed, {s.from_memory} reused in memory, {s.from_disk} read from disk"
        )
        if self.cache_dir is not None:
            entries, size = self.disk_bytes()
            line += f"; {self.cache_dir}: {entries} entries, {size / 2**20:.1f} MiB"
            if self.disk_failed is not None:
                line += f" (not written: {self.disk_failed})"
        return line


def _captured_from(
    tensors: dict[str, torch.Tensor], lengths: Sequence[int], dtype: torch.dtype
) -> Captured:
    """A Captured from disk tensors, after checking they fit the sequences they stand for."""
    hidden, mask = tensors["hidden"], tensors["mask"]
    n, width = len(lengths), max(lengths)
    if hidden.dtype != dtype or hidden.dim() != 3 or tuple(hidden.shape[:2]) != (n, width):
        raise ValueError("hidden states of another shape or dtype")
    if mask.dtype != torch.bool or tuple(mask.shape) != (n, width):
        raise ValueError("mask of another shape")
    if mask.sum(-1).tolist() != list(lengths):
        raise ValueError("mask does not match the sequence lengths")
    entropy = tensors.get("entropy")
    if entropy is not None and tuple(entropy.shape) != (n, width):
        raise ValueError("entropy of another shape")
    head = OutputHead.from_tensors(tensors) if "head.weight" in tensors else None
    if head is not None and head.weight.shape[1] != hidden.shape[2]:
        raise ValueError("head of another shape")
    return Captured(hidden=hidden, mask=mask, entropy=entropy, head=head)


def _covers(captured: Captured, with_entropy: bool, with_head: bool) -> bool:
    return (captured.entropy is not None or not with_entropy) and (
        captured.head is not None or not with_head
    )
