"""Hidden-state capture: run one causal LM over token sequences and keep what training needs.

The surgery acts on the input of the output embedding (after the final norm), so that is what is
recorded, through a forward pre-hook on ``model.get_output_embeddings()``; this works for any HF
causal LM without knowing its module names. For the merged model the hook stops the forward right
there (its logits are needed at most on the first batch, to check the head); for a target, the
per-token entropy of its own next-token distribution is computed batch by batch in float32, so an
N x T x V tensor never exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from mergekit_darts.config.schema import default
from mergekit_darts.correction.head import OutputHead
from mergekit_darts.correction.metrics import token_entropy
from mergekit_darts.errors import NonFiniteCapture, UnsupportedModelError


@dataclass
class Captured:
    """Right-padded hidden states of N sequences and what goes with them."""

    hidden: torch.Tensor  # [N, T, H], cache dtype
    mask: torch.Tensor  # [N, T] bool, True = real token
    entropy: torch.Tensor | None = None  # [N, T] float32 (targets only)
    head: OutputHead | None = None  # the real output path, for kl / ce and the logit metrics

    @property
    def nbytes(self) -> int:
        tensors = (self.hidden, self.mask, self.entropy)
        tensors += (self.head.weight, self.head.bias) if self.head is not None else ()
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


MODEL_FIX = (
    "the model itself computes them (NaN or inf weights, or an overflow of its dtype): check "
    "its weights, or use a wider dtype (bfloat16 or float32)"
)


def require_finite(values: torch.Tensor, what: str, rows: slice, fix: str = MODEL_FIX) -> None:
    """Raise :class:`NonFiniteCapture` naming ``what``, the sequences and ``fix`` unless finite."""
    if not bool(values.isfinite().all()):
        bad = int((~values.isfinite()).sum())
        raise NonFiniteCapture(
            f"{what} that are not finite ({bad} NaN or inf values on calibration sequences "
            f"{rows.start}-{rows.stop - 1}); {fix}"
        )


class _StopForward(Exception):
    """Raised by the capture hook once the hidden state is in hand and logits are not needed."""


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token id lists into ``input_ids`` and ``attention_mask`` [B, T]."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask


def input_device(model: nn.Module) -> torch.device:
    """Where a model wants its inputs: HF's ``model.device`` knows about ``device_map`` models.

    With its first weights offloaded that is ``meta``; accelerate's hooks then move the inputs
    to where each layer computes, so the CPU will do.
    """
    device = getattr(model, "device", None)
    device = device if isinstance(device, torch.device) else next(model.parameters()).device
    return torch.device("cpu") if device.type == "meta" else device


ENTROPY_CHUNK = 64  # positions per token_entropy call: its float32 temporaries are [64, V]


def _store_entropy(
    entropy: torch.Tensor, start: int, width: int, logits: torch.Tensor, device: torch.device | str
) -> None:
    """Entropy of each row's next-token distributions, ``ENTROPY_CHUNK`` positions at a time.

    ``token_entropy`` makes about three float32 temporaries the size of its input; chunking keeps
    them at [64, V] (25 MB at V = 32000) instead of [T, V] (200 MB at T = 512).
    """
    for i, row_logits in enumerate(logits):
        for j in range(0, width, ENTROPY_CHUNK):
            chunk = row_logits[j : j + ENTROPY_CHUNK]
            entropy[start + i, j : j + chunk.shape[0]] = token_entropy(chunk).to(device)


def _forward(model: nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> Any:
    """The model's output, or None when the head hook stopped the pass (no logits needed)."""
    try:
        return model(input_ids=ids, attention_mask=attn, use_cache=False)
    except _StopForward:
        return None


def _store_states(
    hidden: torch.Tensor, mask: torch.Tensor, rows: slice, states: torch.Tensor, attn: torch.Tensor
) -> None:
    """One batch's final hidden states into the cache (its dtype and device), refused in one
    line where they, or their cast to the cache dtype, are not finite."""
    t = attn.shape[1]
    real = attn.to(device=states.device, dtype=torch.bool)
    require_finite(states[real], f"hidden states ({states.dtype})", rows)
    hidden[rows, :t] = states.to(device=hidden.device, dtype=hidden.dtype)
    mask[rows, :t] = attn.to(device=mask.device, dtype=torch.bool)
    kept = hidden[rows, :t][mask[rows, :t]]
    cast = f"hidden states cast to the cache dtype {hidden.dtype}"
    require_finite(kept, cast, rows, "set cache_dtype: bfloat16 or float32")


@torch.no_grad()  # not inference_mode: the cached tensors feed training
def capture(
    model: nn.Module,
    sequences: Sequence[Sequence[int]],
    *,
    batch_size: int = default("batch_size"),
    with_entropy: bool = False,
    with_head: bool = False,
    cache_dtype: torch.dtype = torch.bfloat16,
    cache_device: torch.device | str = "cpu",
    pad_id: int = 0,
    desc: str = "capture",
    progress: bool = True,
    shared_head: OutputHead | None = None,
    require_head: str | None = None,
) -> Captured:
    """Run ``model`` over ``sequences`` (token id lists, no padding) and record final hidden states.

    Positions are right-padded, so token ``t`` of each sequence sits at position ``t``: exactly
    the absolute position the surgery's position table is indexed by. ``with_head`` records the
    model's output path (:class:`OutputHead`) and checks it against the model's own logits on the
    first batch, which for the merged model costs one full forward pass more. ``shared_head``: this
    model's head from an earlier capture, shared instead of copied (at 7B a float32 head is
    0.5 GB per copy) and not checked again. ``require_head`` (e.g. "loss kl") raises
    :class:`~mergekit_darts.errors.HeadError` right after the first batch when the head does not
    reproduce the model's logits, so an unsupported model fails before the rest is captured.
    """
    if not sequences or any(len(s) == 0 for s in sequences):
        raise ValueError("capture needs at least one sequence and no empty sequence")
    head = model.get_output_embeddings()
    if head is None:
        raise UnsupportedModelError(f"{type(model).__name__} has no output embedding to hook")
    n, width = len(sequences), max(len(s) for s in sequences)
    hidden = torch.zeros((n, width, head.in_features), dtype=cache_dtype, device=cache_device)
    mask = torch.zeros((n, width), dtype=torch.bool, device=cache_device)
    entropy = torch.zeros((n, width), dtype=torch.float32, device=cache_device)
    device = input_device(model)
    seen: list[torch.Tensor] = []
    output = None
    if with_head:
        output = shared_head if shared_head is not None else OutputHead.of(model, cache_device)
    # the first batch's logits verify the head, unless an earlier capture did
    need_logits = with_entropy or (output is not None and output.verified is None)

    def grab(_module: nn.Module, args: tuple) -> None:
        seen.append(args[0])
        if not need_logits:
            raise _StopForward

    handle = head.register_forward_pre_hook(grab)
    try:
        for start in tqdm(range(0, n, batch_size), desc=desc, disable=not progress, leave=False):
            ids, attn = pad_batch(sequences[start : start + batch_size], pad_id)
            seen.clear()
            out = _forward(model, ids.to(device), attn.to(device))
            rows, t = slice(start, start + ids.shape[0]), ids.shape[1]
            _store_states(hidden, mask, rows, seen[0], attn)
            if out is not None and output is not None and output.verified is None:
                output.verify(seen[0], out.logits, attn)
            if require_head is not None and start == 0:
                output.require(require_head)
            if out is not None and with_entropy:
                _store_entropy(entropy, start, t, out.logits, cache_device)
                found = entropy[rows, :t][mask[rows, :t]]
                require_finite(found, "next-token entropies (from its logits)", rows)
            need_logits = with_entropy
            # Drop this batch's logits and hidden state now: held over (by ``out``, or by a loop
            # variable viewing a row of them) they would coexist with the next batch's, two
            # batches of logits at the peak instead of one.
            del out
            seen.clear()
    finally:
        handle.remove()
    hidden[~mask] = 0
    return Captured(
        hidden=hidden,
        mask=mask,
        entropy=entropy if with_entropy else None,
        head=output,
    )
