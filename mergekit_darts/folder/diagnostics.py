"""A task's diagnostics file, ``surgery/diagnostics/<task>.safetensors``: written and read here only.

Calibration stores, per task, what it measured token by token, so ``mergekit-darts report`` draws
the paper's Figure 1 without loading a model and ``hf-darts`` checks lm-eval requests against the
calibration prompts (:mod:`lm_eval_darts.leakage`). Every tensor is [N, T], one row per
calibration sequence, right-padded:

- ``input_ids`` (int64, 0 past the sequence) and ``mask`` (bool, its real tokens);
- ``loss_mask`` (bool): the tokens the loss and ρ_L1 counted;
- ``delta_before`` / ``delta_after`` (float32): δ_t before and after the module;
- ``completion_mask`` (bool, with completions): the target's completion tokens;
- ``entropy`` (float32, when captured): the target's next-token entropy, EWL1's weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from mergekit_darts.errors import SurgeryFormatError
from mergekit_darts.folder.manifest import TaskEntry
from mergekit_darts.messages import first_line

DIAGNOSTICS_FORMAT = "darts-surgery-diagnostics"  # the file's one metadata value


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone(memory_format=torch.contiguous_format)


def diagnostics_bytes(
    sequences: Sequence[Sequence[int]],
    mask: torch.Tensor,
    loss_mask: torch.Tensor,
    delta_before: torch.Tensor,
    delta_after: torch.Tensor,
    *,
    completion_mask: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> bytes:
    """The file's bytes: ``sequences`` (token id lists) right-padded to ``mask``'s [N, T].

    Each tensor is copied (they are [N, T], small): safetensors refuses two names that share
    memory, and a caller may pass one tensor twice (the same mask as ``mask`` and ``loss_mask``).
    """
    ids = torch.zeros(mask.shape, dtype=torch.int64)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(seq)
    tensors = {
        "input_ids": ids,
        "mask": _copy(mask),
        "loss_mask": _copy(loss_mask),
        "delta_before": _copy(delta_before),
        "delta_after": _copy(delta_after),
    }
    if completion_mask is not None:
        tensors["completion_mask"] = _copy(completion_mask)
    if entropy is not None:
        tensors["entropy"] = _copy(entropy)
    # One metadata key: safetensors orders several at random, and the bytes must be reproducible.
    return save(tensors, metadata={"format": DIAGNOSTICS_FORMAT})


def diagnostics_path(surgery_dir: Path, entry: TaskEntry | None) -> Path | None:
    """The task's diagnostics file in ``surgery_dir``; None when its manifest entry names none or
    the file is not there (a folder written without them, or with them removed)."""
    if entry is None or not entry.diagnostics:
        return None
    path = surgery_dir / entry.diagnostics
    return path if path.is_file() else None


REQUIRED = (
    "input_ids",
    "mask",
    "delta_before",
    "delta_after",
)  # every version of the file has them


def read_diagnostics(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file, by name; :class:`SurgeryFormatError` when it cannot be read."""
    tensors = _readable(path, lambda: load_file(path))
    missing = [name for name in REQUIRED if name not in tensors]
    if missing:
        raise SurgeryFormatError(f"{path} is not a diagnostics file (no {', '.join(missing)})")
    return tensors


def read_token_ids(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(``input_ids``, ``mask`` as bool) only, without reading the per-token measurements."""

    def read() -> tuple[torch.Tensor, torch.Tensor]:
        with safe_open(path, framework="pt") as file:
            return file.get_tensor("input_ids"), file.get_tensor("mask").bool()

    return _readable(path, read)


def _readable(path: Path, read: Callable[[], Any]) -> Any:
    """``read()``, with a file that is cut, corrupt or missing a tensor as one line naming it."""
    try:
        return read()
    except (OSError, SafetensorError, KeyError) as err:
        why = f"no tensor {err}" if isinstance(err, KeyError) else first_line(str(err))
        raise SurgeryFormatError(f"{path} is not a readable diagnostics file ({why})") from None
