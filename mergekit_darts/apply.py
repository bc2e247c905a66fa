"""Attach a surgery module to a Hugging Face causal LM with hooks (no weight edits).

``apply_surgery`` and the lm-eval ``hf-darts`` class both use this. It runs the exported model's
own mechanism (:mod:`mergekit_darts.correction.darts_correction`), so ``apply_surgery`` and an exported folder
give the same numbers by construction:

* a forward pre-hook on the whole model, and on every module inside it that ends in the same
  output embedding (a wrapper such as peft's ``PeftModel``, whose ``generate`` calls the wrapped
  model directly and whose ``forward(*args, **kwargs)`` names no argument), records the call's token positions (0 = first real
  token, pads = -1, read by name from ``attention_mask`` / ``position_ids`` / the KV cache) and
  ``logits_to_keep``, per thread, and a forward hook that always runs forgets them when the call
  returns, so the head called directly afterwards is left alone (never corrected with an earlier
  call's positions);
* a forward pre-hook on the output embedding replaces its input ``h`` by ``module(h, p)``; the
  model's pre-hook moves it to the output embedding the model has at each call, so one that
  ``resize_token_embeddings`` put in place of the hooked one is corrected too.

One handle per model: a second ``apply_surgery`` (or ``SurgeryHandle``) on a model replaces the
first, whose hooks come off, so a re-run notebook cell never stacks two corrections. The model's
own hooks say which handle it has, so a ``copy.deepcopy`` of a corrected model, which carries a
copy of the hooks and their handle, is corrected once, and once again after ``apply_surgery``.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from mergekit_darts.correction.darts_correction import (
    SURGERY,
    Correction,
    RoutedSurgery,
    SurgeryModule,
    corrected_head_input,
    enter_call,
    leave_call,
    positional_names,
)
from mergekit_darts.errors import ModelArgsError, SurgeryFormatError, UnsupportedModelError
from mergekit_darts.task_map import JOINT, NONE, ROUTED

__all__ = ["Correction", "SurgeryHandle", "apply_surgery", "model_folder"]

_REGISTERING = threading.Lock()  # hooks go on and come off one model at a time


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
            raise UnsupportedModelError(
                f"{type(model).__name__} has no output embedding to attach surgery to"
            )
        if hasattr(model, SURGERY):
            raise UnsupportedModelError(
                f"{type(model).__name__} is a DARTS export that applies its own surgery; apply "
                "surgery to the merged model it was exported from, or use the export as it is"
            )
        self.hidden_size = head.in_features
        self.module = module
        self._folder, self._weights = folder, weights
        self._head: nn.Module | None = None
        self._head_hook: RemovableHandle | None = None
        callers = _callers(model, head)
        # per caller class: the names of its positional forward arguments, and where the head
        # sits below it, read there at each call (get_output_embeddings costs about 20 us, a dict
        # lookup per level under 1 us); keyed by class so a deepcopy's modules find theirs
        self._calls = {
            type(caller): (positional_names(type(caller).forward), _path_to(caller, head))
            for caller in callers
        }
        with _REGISTERING:
            earlier = _handle_of(model)
            if earlier is not None:
                earlier._unhook()
            self._handles = [
                hook
                for caller in callers
                for hook in (
                    caller.register_forward_pre_hook(self._enter, with_kwargs=True),
                    caller.register_forward_hook(self._leave, always_call=True),
                )
            ]
            self._hook_head(head)
        if earlier is not None:
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
            raise SurgeryFormatError(
                f"surgery hidden size {module.hidden_size} does not match the model's "
                f"{self.hidden_size}"
            )
        self._module = module

    def set_task(self, task: str | None) -> None:
        """Correct with another task of the ``surgery/`` folder this handle was applied from
        (``"routed"``: every routed task behind the router; ``"joint"``: the joint correction;
        None or ``"none"``: no correction)."""
        if self._folder is None:
            raise ModelArgsError(
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

    def _hook_head(self, head: nn.Module) -> None:
        """Correct ``head``'s input from now on, and no longer the head hooked before."""
        if self._head_hook is not None:
            self._head_hook.remove()
        self._head, self._head_hook = head, head.register_forward_pre_hook(self._correct)

    def _enter(self, caller: nn.Module, args: tuple, kwargs: dict) -> None:
        names, head_path = self._calls[type(caller)]
        if _submodule(caller, head_path) is not self._head:  # resize_token_embeddings
            head = caller.get_output_embeddings()
            with _REGISTERING:
                if head is not self._head and self._handles:
                    self._hook_head(head)
        enter_call(id(self), {**dict(zip(names, args, strict=False)), **kwargs})

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
        with _REGISTERING:
            self._unhook()

    def _unhook(self) -> None:
        for handle in [*self._handles, self._head_hook]:
            if handle is not None:
                handle.remove()
        self._handles.clear()
        self._head, self._head_hook = None, None

    def __enter__(self) -> SurgeryHandle:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.remove()


def apply_surgery(
    model: nn.Module, path: str | Path | Correction, task: str | None = None
) -> SurgeryHandle:
    """Correct ``model``'s final hidden state with the surgery module of ``task`` stored at ``path``.

    ``path`` is a ``surgery/`` folder (``task`` may be omitted when it holds one task; ``"routed"``
    applies every routed task's module behind the folder's router, ``"joint"`` the joint plain
    correction of every task) or an already-built
    :class:`SurgeryModule` / :class:`RoutedSurgery`. A folder calibrated on other weights than
    the model's (its local folder, ``model.name_or_path``; else the one around ``path``) is refused.
    Surgery applied to ``model`` before is replaced. Returns a handle whose ``remove()`` undoes it.
    """
    if isinstance(path, SurgeryModule | RoutedSurgery):
        return SurgeryHandle(model, path.eval())
    weights = model_folder(model)
    module = _load(Path(path), task, weights)
    return SurgeryHandle(model, module, folder=Path(path), weights=weights)


def _load(folder: Path, task: str | None, weights: Path | None) -> Correction:
    from mergekit_darts.folder.artifacts import load_joint, load_routed, load_surgery

    if task == ROUTED:
        return load_routed(folder, weights=weights).eval()
    if task == JOINT:
        return load_joint(folder, weights=weights)
    return load_surgery(folder, task, weights=weights).eval()


def _callers(model: nn.Module, head: nn.Module) -> list[nn.Module]:
    """``model`` and every module inside it that ends in the same ``head``: whichever of them a
    call goes through records the token positions, innermost last (the one the head sees)."""
    inner = [
        module
        for module in model.modules()
        if module is not model
        and callable(getattr(module, "get_output_embeddings", None))
        and module.get_output_embeddings() is head
    ]
    return [model, *inner]


def _path_to(model: nn.Module, head: nn.Module) -> tuple[str, ...]:
    """The names from ``model`` down to ``head``."""
    return next((tuple(name.split(".")) for name, m in model.named_modules() if m is head), ())


def _submodule(model: nn.Module, path: tuple[str, ...]) -> nn.Module | None:
    """The module at ``path`` (names from ``model`` down), or None."""
    found: nn.Module | None = model
    for name in path:
        found = None if found is None else found._modules.get(name)
    return found


def _handle_of(model: nn.Module) -> SurgeryHandle | None:
    """The handle whose hooks ``model`` carries, if any (found on the model itself, so a copy of
    a corrected model has its own copy's)."""
    for hook in model._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)
        if isinstance(owner, SurgeryHandle):
            return owner
    return None


def model_folder(model: object) -> Path | None:
    """The local folder a model was loaded from (``name_or_path``), or None (Hub id, built)."""
    name = getattr(model, "name_or_path", None)
    return Path(name) if isinstance(name, str) and name and Path(name).is_dir() else None
