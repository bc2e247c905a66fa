"""How calibration runs a model: where it loads, in which dtype, and what a failure says.

Every task of a run shares one :class:`Runtime` (device, device map, cache dtype, the merged
model's tokenizer). A model is wrapped in :class:`LazyModel` so that one whose captures the store
already holds is never loaded, and one that is needed is loaded once. :func:`stage` turns any
failure inside a step into one line that names the task and the step: a user sees which of
``loading``, ``generating``, ``capturing`` or ``training`` failed without a traceback.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mergekit_darts.calibrate.store import StoreStats
from mergekit_darts.config import SurgeryConfig, by_files, resolve_device
from mergekit_darts.errors import DartsError, SurgeryConfigError, SurgeryRunError

UNCHANGED = "the merged model and any existing surgery/ folder are unchanged"  # after a failure


@contextmanager
def stage(task: str | None, what: str) -> Iterator[None]:
    """Turn any failure into one line naming the task and what it was doing."""
    try:
        yield
    except DartsError:
        raise
    except Exception as err:
        who = f"surgery task {task!r}" if task else "surgery"
        detail = " ".join(f"{type(err).__name__}: {err}".split())[:400]
        raise SurgeryRunError(f"{who} failed while {what}: {detail}; {UNCHANGED}") from err


@contextmanager
def timer(timings: dict[str, float], name: str) -> Iterator[None]:
    """Record the seconds the block took as ``timings[name]`` (the manifest's timings)."""
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start


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
    """Give a dropped model's memory back before the next one loads (one model at a time)."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def pad_id(tokenizer: Any) -> int:
    """A filler id for padded slots (masked out everywhere, so any real id will do)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, int):
            return candidate
    return 0


class LazyModel:
    """A model loaded on first use, so one whose captures are all stored is never loaded."""

    def __init__(self, path: str, label: str, runtime: Runtime, stats: StoreStats) -> None:
        self.path, self.label, self.runtime, self.stats = path, label, runtime, stats
        self._model: nn.Module | None = None

    def get(self, task: str | None, timings: dict[str, float], timing: str) -> nn.Module:
        """The model, loaded now if it was not (counted in ``stats``, timed as ``timing``)."""
        if self._model is None:
            with stage(task, f"loading {self.label}"), timer(timings, timing):
                self._model = load_model(self.path, self.runtime)
            self.stats.model_loads += 1
        return self._model

    def close(self) -> None:
        """Drop the model, if it was loaded, and give its memory back."""
        if self._model is not None:
            self._model = None
            release(self.runtime.device)
