"""Attach a surgery module to a Hugging Face causal LM with hooks (no weight edits).

``apply_surgery`` and the lm-eval ``hf-darts`` class both use this. It runs the exported model's
own mechanism (:mod:`mergekit_darts.core.correction`), so ``apply_surgery`` and an exported folder
give the same numbers by construction:

* a forward pre-hook on the whole model records the call's token positions (0 = first real
  token, pads = -1, read by name from ``attention_mask`` / ``position_ids`` / the KV cache) and
  ``logits_to_keep``, per thread, and a forward hook that always runs forgets them when the call
  returns, so the head called directly afterwards is left alone (never corrected with an earlier
  call's positions);
* a forward pre-hook on the output embedding replaces its input ``h`` by ``module(h, p)``.

One handle per model: a second ``apply_surgery`` (or ``SurgeryHandle``) on a model replaces the
first, whose hooks come off, so a re-run notebook cell never stacks two corrections.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn

from mergekit_darts.core.correction import (
    SURGERY,
    Correction,
    DartsRoutedSurgery,
    DartsSurgery,
    corrected_head_input,
    enter_call,
    leave_call,
    positional_names,
)
from mergekit_darts.task_map import NONE, ROUTED

__all__ = ["Correction", "SurgeryHandle", "apply_surgery", "model_folder"]

# model -> its live handle (weak: a model that is gone takes its entry with it)
_HANDLES: weakref.WeakKeyDictionary[nn.Module, SurgeryHandle] = weakref.WeakKeyDictionary()
_REGISTERING = threading.Lock()


class SurgeryHandle:
    """Live surgery on one model; ``module`` may be swapped (or set to None) between calls.

    Use as a context manager or call :meth:`remove` to take the hooks off again. ``set_task``
    switches to another task of the folder it was applied from; ``with handle.disabled():`` runs
    the plain model for a while.
    """

    def __init__(
        self,
        model: nn.Module,
        module: Correction | None,
        *,
        folder: Path | None = None,
        weights: Path | None = None,
    ):
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embedding to attach surgery to")
        if hasattr(model, SURGERY):
            raise ValueError(
                f"{type(model).__name__} is a DARTS export that applies its own surgery; apply "
                "surgery to the merged model it was exported from, or use the export as it is"
            )
        self.hidden_size = head.in_features
        self.module = module
        self._folder, self._weights = folder, weights
        self._forward_names = positional_names(type(model).forward)
        self._model = weakref.ref(model)
        self._handles = [
            model.register_forward_pre_hook(self._enter, with_kwargs=True),
            model.register_forward_hook(self._leave, always_call=True),
            head.register_forward_pre_hook(self._correct),
        ]
        with _REGISTERING:
            earlier = _HANDLES.get(model)
            _HANDLES[model] = self
        if earlier is not None:
            earlier.remove()
            warnings.warn(
                f"{type(model).__name__} already had DARTS surgery applied: it was replaced (one "
                "correction at a time; the earlier handle is removed)",
                stacklevel=3,
            )

    @property
    def module(self) -> Correction | None:
        return self._module

    @module.setter
    def module(self, module: Correction | None) -> None:
        if module is not None and module.hidden_size != self.hidden_size:
            raise ValueError(
                f"surgery hidden size {module.hidden_size} does not match the model's "
                f"{self.hidden_size}"
            )
        self._module = module

    def set_task(self, task: str | None) -> None:
        """Correct with another task of the ``surgery/`` folder this handle was applied from
        (``"routed"``: every routed task behind the router; None or ``"none"``: no correction)."""
        if self._folder is None:
            raise ValueError(
                "this handle was applied with a module, not a surgery folder: assign "
                "handle.module instead"
            )
        self.module = None if task in (None, NONE) else _load(self._folder, task, self._weights)

    @contextmanager
    def disabled(self) -> Iterator[SurgeryHandle]:
        """The plain model inside the block (hooks stay, inert); the correction is back after."""
        module, self._module = self._module, None
        try:
            yield self
        finally:
            self._module = module

    def _enter(self, _model: nn.Module, args: tuple, kwargs: dict) -> None:
        enter_call(id(self), {**dict(zip(self._forward_names, args, strict=False)), **kwargs})

    def _leave(self, *_: Any) -> None:
        leave_call(id(self))

    def _correct(self, _head: nn.Module, args: tuple) -> tuple | None:
        module, h = self._module, args[0]
        where = None if module is None else module.device()
        if where is not None and where != h.device:  # accelerate may put the head anywhere
            module = self._module = module.to(h.device)
        h_hat = corrected_head_input(id(self), module, h)
        return None if h_hat is None else (h_hat, *args[1:])

    def remove(self) -> None:
        """Take the hooks off: the model is the plain model again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        model = self._model()
        with _REGISTERING:
            if model is not None and _HANDLES.get(model) is self:
                del _HANDLES[model]

    def __enter__(self) -> SurgeryHandle:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.remove()


def apply_surgery(
    model: nn.Module, path: str | Path | Correction, task: str | None = None
) -> SurgeryHandle:
    """Correct ``model``'s final hidden state with the surgery module of ``task`` stored at ``path``.

    ``path`` is a ``surgery/`` folder (``task`` may be omitted when it holds one task; ``"routed"``
    applies every routed task's module behind the folder's router) or an already-built
    :class:`DartsSurgery` / :class:`DartsRoutedSurgery`. A folder calibrated on other weights than
    the model's (its local folder, ``model.name_or_path``; else the one around ``path``) is refused.
    Surgery applied to ``model`` before is replaced. Returns a handle whose ``remove()`` undoes it.
    """
    if isinstance(path, DartsSurgery | DartsRoutedSurgery):
        return SurgeryHandle(model, path.eval())
    weights = model_folder(model)
    module = _load(Path(path), task, weights)
    return SurgeryHandle(model, module, folder=Path(path), weights=weights)


def _load(folder: Path, task: str | None, weights: Path | None) -> Correction:
    from mergekit_darts.artifacts import load_routed, load_surgery

    if task == ROUTED:
        return load_routed(folder, weights=weights).eval()
    return load_surgery(folder, task, weights=weights).eval()


def model_folder(model: object) -> Path | None:
    """The local folder a model was loaded from (``name_or_path``), or None (Hub id, built)."""
    name = getattr(model, "name_or_path", None)
    return Path(name) if isinstance(name, str) and name and Path(name).is_dir() else None
