"""The capture store: calibrate once, train many.

Captured hidden states depend only on the model (config, weights, tokenizer), the token
sequences, the cache dtype and how they were computed (capture batch size, device, library
versions); never on the module, loss, rank, learning rate, steps or seed. So they are kept under
a key of exactly those things: in memory for a run (a sweep's cells, the tasks of one block) and,
with ``cache_dir``, on disk as safetensors written under a temporary name and renamed, so a
killed run never leaves half an entry that looks whole. An entry that fails any check on reading
is recomputed and overwritten, never used.

A model is loaded only when at least one of its captures (or prompt completions) is missing, and
then once for all of them: a block's K tasks cost (distinct targets + 1) loads, and a warm store
loads none. Weight files are identified by (name, size, mtime_ns, ctime_ns, inode), the way make
and ccache's direct mode trust file metadata, because hashing 14 GB of a 7B checkpoint would take
longer than loading it; every other file of the folder (config, tokenizer, generation config) is
hashed by content.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import itertools
import json
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from mergekit_darts.calibrate.capture import Captured, capture
from mergekit_darts.calibrate.continuation import completion_mask, continue_prompts, eos_token_ids
from mergekit_darts.config import ResolvedTask, SurgeryConfig, by_files, resolve_device
from mergekit_darts.core.head import OutputHead
from mergekit_darts.errors import SurgeryConfigError, SurgeryError, SurgeryRunError

FORMAT = "darts-capture-store"
STORE_VERSION = 1
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
CAPTURES, COMPLETIONS = "captures", "completions"


@contextmanager
def stage(task: str | None, what: str) -> Iterator[None]:
    """Turn any failure into one line naming the task and what it was doing."""
    try:
        yield
    except SurgeryError:
        raise
    except Exception as err:
        who = f"surgery task {task!r}" if task else "surgery"
        detail = " ".join(f"{type(err).__name__}: {err}".split())[:400]
        raise SurgeryRunError(
            f"{who} failed while {what}: {detail}; the merged model and any existing surgery/ "
            "folder are unchanged"
        ) from err


# ---- what determines a capture -------------------------------------------------------------------


def model_identity(ref: str) -> str:
    """A key for the model at ``ref``: a local folder's files, or the Hub id itself.

    The model card, ``surgery/`` and hidden files are left out: writing a surgery into a merged
    folder must not make its captures look stale.
    """
    folder = Path(ref)
    if not folder.is_dir():
        return "hub:" + ref  # disk entries need a local folder (see CaptureStore)
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.suffix == ".md" or not path.is_file():
            continue
        digest.update(path.name.encode() + b"\0")
        if path.suffix in WEIGHT_SUFFIXES:
            st = path.stat()
            digest.update(f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}".encode())
        else:
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        digest.update(b"\0")
    return "local:" + digest.hexdigest()


def sequences_sha256(sequences: Sequence[Sequence[int]]) -> str:
    """sha256 of token id lists (one line of comma-separated ids each)."""
    text = "\n".join(",".join(map(str, seq)) for seq in sequences)
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _versions() -> dict[str, str]:
    return {p: version(p) for p in ("torch", "transformers")}


def _key(kind: str, **parts: Any) -> str:
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
    """The store's folder (resolved from the working directory), created and checked writable.

    Called before any model is loaded, so a bad ``cache_dir`` costs no merge and no capture.
    """
    if not cache_dir:
        return None
    folder = Path(cache_dir).expanduser().resolve()
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
    return folder


class CaptureStore:
    """Captures and prompt completions by key: in memory, and on disk under ``cache_dir``."""

    def __init__(self, cache_dir: str | Path | None = None) -> None:
        self.cache_dir = check_cache_dir(cache_dir)
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
        identity = model_identity(model)
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
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
            if meta.get("format") != FORMAT or meta.get("key") != key:
                raise ValueError("not this entry")
            return load_file(path, device=device)
        except Exception:  # truncated, corrupt, foreign: recompute, never use
            self._discard(kind, key)
            return None

    def _write(self, kind: str, key: str, tensors: dict[str, torch.Tensor]) -> None:
        if self.cache_dir is None:
            return
        path = self._path(kind, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            save_file(tensors, tmp, metadata={"format": FORMAT, "key": key})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

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


def _view(captured: Captured, with_entropy: bool, with_head: bool) -> Captured:
    """Exactly the fields asked for (an entry may hold more), sharing the tensors."""
    return Captured(
        hidden=captured.hidden,
        mask=captured.mask,
        entropy=captured.entropy if with_entropy else None,
        head=captured.head if with_head else None,
    )


def _covers(captured: Captured, with_entropy: bool, with_head: bool) -> bool:
    return (captured.entropy is not None or not with_entropy) and (
        captured.head is not None or not with_head
    )


# ---- loading models ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Runtime:
    """How models are loaded and captures computed: the same for every task of a run."""

    device: str
    device_map: str | None
    trust_remote_code: bool
    cache_dtype: torch.dtype
    tokenizer: Any  # the merged model's: its EOS ends completions
    pad_id: int
    progress: bool

    @classmethod
    def of(cls, config: SurgeryConfig, tokenizer: Any, progress: bool) -> Runtime:
        return cls(
            resolve_device(config.device),
            config.device_map,
            config.trust_remote_code,
            getattr(torch, config.cache_dtype),
            tokenizer,
            pad_id(tokenizer),
            progress,
        )


def merged_tokenizer(merged: str | Path, trust_remote_code: bool) -> Any:
    """The merged folder's tokenizer: calibration tokenizes with it for every model."""
    from transformers import AutoTokenizer

    def load() -> Any:
        try:
            return AutoTokenizer.from_pretrained(merged, trust_remote_code=trust_remote_code)
        except Exception as err:  # no tokenizer files, or unreadable ones
            raise SurgeryConfigError(
                f"{merged} has no usable tokenizer ({type(err).__name__}); calibration tokenizes "
                "with the merged model's tokenizer: copy one into the folder"
            ) from err

    return by_files(_TOKENIZERS, str(merged), trust_remote_code, load)


_TOKENIZERS: dict[Any, Any] = {}


def load_model(path: str, runtime: Runtime) -> nn.Module:
    """One full model in the dtype its config records (the merge's ``dtype`` for the merge)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype="auto",
        device_map=runtime.device_map or runtime.device,
        trust_remote_code=runtime.trust_remote_code,
    )
    return model.eval()


def release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def pad_id(tokenizer: Any) -> int:
    """A filler id for padded slots (masked out everywhere, so any real id will do)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, int):
            return candidate
    return 0


class _LazyModel:
    """A model loaded on first use, so one whose captures are all stored is never loaded."""

    def __init__(self, path: str, label: str, runtime: Runtime, store: CaptureStore) -> None:
        self.path, self.label, self.runtime, self.store = path, label, runtime, store
        self._model: nn.Module | None = None

    def get(self, task: str | None, timings: dict[str, float], timing: str) -> nn.Module:
        if self._model is None:
            with stage(task, f"loading {self.label}"), _timer(timings, timing):
                self._model = load_model(self.path, self.runtime)
            self.store.stats.model_loads += 1
        return self._model

    def close(self) -> None:
        if self._model is not None:
            self._model = None
            release(self.runtime.device)


# ---- one block's captures ------------------------------------------------------------------------


@dataclass
class Calibration:
    """What one task needs captured, and (after :func:`capture_calibration`) what it got."""

    name: str
    target_path: str  # located: a local folder or a Hub id
    prompt_ids: list[list[int]]
    continuation_tokens: int
    batch_size: int
    with_head: bool
    sequences: list[list[int]] = field(default_factory=list)
    completions: list[list[int]] | None = None
    completion_mask: torch.Tensor | None = None
    target: Captured | None = None
    merged: Captured | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, task: ResolvedTask, prompt_ids: list[list[int]], target: str) -> Calibration:
        return cls(
            name=task.name,
            target_path=target,
            prompt_ids=prompt_ids,
            continuation_tokens=task.calibration.continuation_tokens,
            batch_size=task.batch_size,
            with_head=task.needs_head,
        )


def capture_calibration(
    store: CaptureStore, merged: str, calibrations: list[Calibration], runtime: Runtime
) -> None:
    """Targets one at a time (completions first), then the merged model: each loaded at most once."""
    for target, group in group_by_target(calibrations).items():
        capture_target(store, target, group, runtime)
    capture_merged(store, merged, calibrations, runtime)


def group_by_target(calibrations: list[Calibration]) -> dict[str, list[Calibration]]:
    """Tasks by target location, in the order the block first names each target."""
    groups: dict[str, list[Calibration]] = {}
    for cal in calibrations:
        groups.setdefault(cal.target_path, []).append(cal)
    return groups


def capture_target(
    store: CaptureStore, target: str, group: list[Calibration], runtime: Runtime
) -> None:
    """Completions, then hidden states with entropy, of every task whose target is ``target``."""
    identity = model_identity(target)
    model = _LazyModel(target, f"target {target}", runtime, store)
    try:
        for cal in group:
            cal.sequences = cal.prompt_ids
            if cal.continuation_tokens:
                _continue(store, identity, model, cal, runtime)
        # entropy always: the target computes its logits anyway, and the report plots it
        _capture_all(store, identity, model, group, runtime, "target", with_entropy=True)
    finally:
        model.close()


def capture_merged(
    store: CaptureStore, merged: str, calibrations: list[Calibration], runtime: Runtime
) -> None:
    """The merged model's hidden states on every task's sequences (its logits are never needed)."""
    model = _LazyModel(merged, f"the merged model {merged}", runtime, store)
    try:
        identity = model_identity(merged)
        _capture_all(store, identity, model, calibrations, runtime, "merged", with_entropy=False)
    finally:
        model.close()


def _continue(
    store: CaptureStore, identity: str, model: _LazyModel, cal: Calibration, runtime: Runtime
) -> None:
    """Extend the prompts with the target's greedy completions (stored like captures)."""
    key = _key(
        COMPLETIONS,
        model=identity,
        prompts=sequences_sha256(cal.prompt_ids),
        max_new_tokens=cal.continuation_tokens,
        tokenizer_eos=runtime.tokenizer.eos_token_id,
        pad_id=runtime.pad_id,
        batch_size=cal.batch_size,
        device=runtime.device,
        device_map=runtime.device_map,
    )
    n = len(cal.prompt_ids)
    completions = store.get_completions(key, n, cal.continuation_tokens, model=identity)
    if completions is None:
        loaded = model.get(cal.name, cal.timings, "load_target_s")
        with (
            stage(cal.name, "generating the target's completions"),
            _timer(cal.timings, "generate_s"),
        ):
            completions = continue_prompts(
                loaded,
                cal.prompt_ids,
                max_new_tokens=cal.continuation_tokens,
                eos_ids=eos_token_ids(loaded, runtime.tokenizer),
                pad_id=runtime.pad_id,
                batch_size=cal.batch_size,
                progress=runtime.progress,
                desc=f"{cal.name}: generate",
            ).completions
        store.stats.computed += 1
        store.put_completions(key, completions, model=identity)
    cal.completions = completions
    cal.sequences = [list(p) + c for p, c in zip(cal.prompt_ids, completions, strict=True)]
    cal.completion_mask = completion_mask(
        [len(p) for p in cal.prompt_ids], [len(c) for c in completions]
    )


def _capture_all(
    store: CaptureStore,
    identity: str,
    model: _LazyModel,
    calibrations: list[Calibration],
    runtime: Runtime,
    role: str,
    *,
    with_entropy: bool,
) -> None:
    """One capture per distinct (sequences, batch size), with what any of its tasks needs."""
    keys = {}
    needs: dict[str, tuple[bool, bool]] = {}
    for cal in calibrations:
        key = _key(
            CAPTURES,
            model=identity,
            sequences=sequences_sha256(cal.sequences),
            cache_dtype=str(runtime.cache_dtype),
            batch_size=cal.batch_size,
            device=runtime.device,
            device_map=runtime.device_map,
        )
        keys[cal.name] = key
        entropy, head = needs.get(key, (False, False))
        needs[key] = (entropy or with_entropy, head or cal.with_head)
    done: dict[str, Captured] = {}
    timing = f"capture_{role}_s"
    for cal in calibrations:
        key = keys[cal.name]
        if key not in done:
            lengths = [len(s) for s in cal.sequences]
            found = store.get(
                key, lengths, runtime.cache_dtype, runtime.device, needs[key], model=identity
            )
            if found is None:
                what = "the target's" if role == "target" else "the merged model's"
                loaded = model.get(cal.name, cal.timings, f"load_{role}_s")
                with (
                    stage(cal.name, f"capturing {what} hidden states"),
                    _timer(cal.timings, timing),
                ):
                    found = capture(
                        loaded,
                        cal.sequences,
                        batch_size=cal.batch_size,
                        with_entropy=needs[key][0],
                        with_head=needs[key][1],
                        cache_dtype=runtime.cache_dtype,
                        cache_device=runtime.device,
                        pad_id=runtime.pad_id,
                        desc=f"{cal.name}: {role}",
                        progress=runtime.progress,
                    )
                store.stats.computed += 1
                store.put(key, found, model=identity)
            done[key] = found
        view = _view(done[key], with_entropy, cal.with_head)
        if role == "target":
            cal.target = view
        else:
            cal.merged = view


@contextmanager
def _timer(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start
