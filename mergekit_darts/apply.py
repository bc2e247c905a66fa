"""Attach a surgery module to a Hugging Face causal LM with hooks (no weight edits).

``apply_surgery`` and the lm-eval ``hf-darts`` class both use this. Two hooks cooperate:

* a forward pre-hook on the whole model reads the call's ``attention_mask`` / ``position_ids`` /
  KV cache (by name, positional arguments included) and works out each token's absolute position
  (0 = first real token, pads = -1), so the result does not depend on batch size or on the
  padding side;
* a forward pre-hook on the output embedding replaces its input ``h`` by ``module(h, p)``, with
  the positions cut the same way the model cut ``h`` for ``logits_to_keep``.

The position rule and the cut are the exported model's own (``deploy/modeling_darts.py``), so
``apply_surgery`` and an exported folder give the same numbers by construction.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch import nn

from mergekit_darts.core.modules import SurgeryModule
from mergekit_darts.core.router import RoutedSurgery
from mergekit_darts.deploy.modeling_darts import call_positions, head_positions, positional_names
from mergekit_darts.routing import ROUTED

Correction = SurgeryModule | RoutedSurgery  # anything with hidden_size and forward(h, positions)


class SurgeryHandle:
    """Live surgery on one model; ``module`` may be swapped (or set to None) between calls.

    Use as a context manager or call :meth:`remove` to take the hooks off again.
    """

    def __init__(self, model: nn.Module, module: Correction | None):
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embedding to attach surgery to")
        hidden_size = head.in_features
        if module is not None and module.hidden_size != hidden_size:
            raise ValueError(
                f"surgery hidden size {module.hidden_size} does not match the model's {hidden_size}"
            )
        self.hidden_size = hidden_size
        self._module = module
        self._forward_names = positional_names(type(model).forward)
        # per thread: threads sharing the model must not see each other's positions
        self._call = threading.local()
        self._handles = [
            model.register_forward_pre_hook(self._read_positions, with_kwargs=True),
            head.register_forward_pre_hook(self._correct),
        ]

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

    def _read_positions(self, _model: nn.Module, args: tuple, kwargs: dict) -> None:
        arguments = {**dict(zip(self._forward_names, args, strict=False)), **kwargs}
        self._call.positions = call_positions(arguments)
        self._call.logits_to_keep = arguments.get("logits_to_keep", 0)

    def _correct(self, _head: nn.Module, args: tuple) -> tuple | None:
        if self._module is None:
            return None
        positions = getattr(self._call, "positions", None)
        if positions is None:
            raise RuntimeError("surgery could not find the token positions of this forward call")
        h = args[0]
        positions = head_positions(positions, self._call.logits_to_keep, h)
        module = self._module
        weight = next(module.parameters(), None)  # None: the `none` module, nothing to move
        if weight is not None and weight.device != h.device:  # accelerate may put the head
            module = self._module = module.to(h.device)  # anywhere; checked cheaply, per token
        positions = positions.to(h.device)
        if not torch.is_autocast_enabled(h.device.type):
            return (module(h, positions), *args[1:])
        # float32 even under autocast (lm-eval's mixed_precision_dtype), which would otherwise
        # run the module's Linear layers in half precision
        with torch.autocast(h.device.type, enabled=False):
            return (module(h, positions), *args[1:])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

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
    :class:`SurgeryModule` / :class:`RoutedSurgery`. A folder calibrated on other weights than the
    model's (its local folder, ``model.name_or_path``; else the one around ``path``) is refused.
    Returns a handle whose ``remove()`` undoes it.
    """
    if isinstance(path, SurgeryModule | RoutedSurgery):
        module = path
    elif task == ROUTED:
        from mergekit_darts.artifacts import load_routed

        module = load_routed(path, weights=model_folder(model))
    else:
        from mergekit_darts.artifacts import load_surgery

        module = load_surgery(path, task, weights=model_folder(model))
    return SurgeryHandle(model, module.eval())


def model_folder(model: object) -> Path | None:
    """The local folder a model was loaded from (``name_or_path``), or None (Hub id, built)."""
    name = getattr(model, "name_or_path", None)
    return Path(name) if isinstance(name, str) and name and Path(name).is_dir() else None
