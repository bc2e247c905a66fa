"""Train on right-padded batches without multiplying the padding rows: the same bits, less work.

About 40 % of a base batch's rows are padding (an expert's: 15-30 %) and almost all of a training
step is the linear layers' SGEMMs. With right padding and causal attention no real token sees a
pad, and a pad's loss is ignored, so every pad row's gradient is zero. :func:`skip_padding` has
each linear layer multiply only the real rows (forward and input gradient) and give the pad rows
zeros; the weight gradient stays the full product, exactly the call of torch's own backward, in
which the pad rows add zeros. A real row's result is then the same bits: MKL's SGEMM rounds a row
the same whatever the other rows, provided the row count is a multiple of :data:`ROW_MULTIPLE`
(the padded batch's count, batch size × width, is one). `tests/test_demo_packed.py` checks the
weights bit for bit against plain training under the demo's pins.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

# the SGEMM row tile: a row rounds the same in any multiple of it (measured under the demo's pins)
ROW_MULTIPLE = 4


class _Rows:
    """One batch's rows (flattened batch × position): which are real, and how to pack them."""

    def __init__(self, input_ids: torch.Tensor, pad_id: int) -> None:
        real = (input_ids != pad_id).flip(-1).cummax(-1).values.flip(-1).reshape(-1)
        self.total = real.numel()
        self.real = real.nonzero().squeeze(1)  # up to each sequence's last non-pad token
        self.pads = (~real).nonzero().squeeze(1)
        extra = -len(self.real) % ROW_MULTIPLE  # the first real row repeated at the end
        self.packed = torch.cat([self.real, self.real[:1].expand(extra)])
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """`x`'s packed rows; the projections that share an input share one copy."""
        if self._gathered is None or self._gathered[0] is not x:
            self._gathered = (x, x.reshape(-1, x.shape[-1]).index_select(0, self.packed))
        return self._gathered[1]

    def scatter(self, packed: torch.Tensor) -> torch.Tensor:
        """The real rows of `packed` in their places among all rows, zeros in the pad rows."""
        out = packed.new_empty(self.total, packed.shape[1])
        out.index_copy_(0, self.real, packed[: len(self.real)])
        return out.index_fill_(0, self.pads, 0.0)


class _RealRowsLinear(torch.autograd.Function):
    """``F.linear(x, weight)`` computed on the real rows only (zeros on the pad rows)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, rows: _Rows) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.rows = rows
        return rows.scatter(F.linear(rows.gather(x), weight)).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        rows: _Rows = ctx.rows
        grad = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = rows.scatter(grad.index_select(0, rows.packed).mm(weight)).view(x.shape)
        if ctx.needs_input_grad[1]:
            # torch's own backward of F.linear's weight: the product over all rows
            grad_w = grad.t().mm(x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w, None


@contextmanager
def skip_padding(model: nn.Module, pad_id: int) -> Iterator[None]:
    """While open, every linear layer of `model` multiplies only the real rows of the batch
    (`input_ids` passed by keyword, right-padded with `pad_id`); restored on exit."""
    batch: list[_Rows] = []

    def on_call(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        batch[:] = [_Rows(kwargs["input_ids"], pad_id)]

    def packed(linear: nn.Linear) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            rows = batch[0]
            if x.shape[:-1].numel() != rows.total or linear.bias is not None:
                raise RuntimeError("skip_padding: a linear layer saw other rows than the batch's")
            return _RealRowsLinear.apply(x, linear.weight, rows)

        return forward

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    hook = model.register_forward_pre_hook(on_call, with_kwargs=True)
    for linear in linears:
        linear.forward = packed(linear)
    try:
        yield
    finally:
        hook.remove()
        for linear in linears:
            del linear.forward
