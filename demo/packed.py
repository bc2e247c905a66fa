"""Train on right-padded batches without multiplying the padding rows: the same bits, less work.

About 40 % of a base batch's rows are padding (an expert's: 15-30 %) and almost all of a training
step is the linear layers' SGEMMs. With right padding and causal attention no real token sees a
pad, and a pad's loss is ignored, so every pad row's gradient is zero. :func:`skip_padding` has
each linear layer multiply only the real rows (forward and input gradient) and give the pad rows
zeros. A real row's result is then the same bits: MKL's SGEMM rounds a row the same whatever the
other rows, provided the row count is a multiple of :data:`ROW_MULTIPLE` (the padded batch's
count, batch size × width, is one). The weight gradient stays the full product, exactly the call
of torch's own backward, in which the pad rows add zeros: it sums over the rows in blocks, and
dropping rows would move the blocks' edges.

The weight gradients need nothing that comes after them in the backward pass, so they run on a
second thread while the backward pass goes on, and so does the last projection of an input that
several read (value, up) while the main thread computes the others: each is the same
single-threaded SGEMM call, so the same bits, and a second core takes about half the SGEMM work
off the critical path. `tests/test_demo_packed.py` checks the weights bit for bit against plain
training under the demo's pins."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
        self.real = real.nonzero().squeeze(1)  # up to each sequence's last non-pad token
        # packed: the real rows, then zero rows (one at least) up to a multiple of ROW_MULTIPLE
        self.packed_rows = len(self.real) + 1 + (-len(self.real) - 1) % ROW_MULTIPLE
        # for every row of the batch, its packed row; a pad row, the first zero row
        self.unpack = torch.full_like(real, len(self.real), dtype=torch.long)
        self.unpack[self.real] = torch.arange(len(self.real))
        self.total = real.numel()
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None
        # projections computed ahead on the worker: their input and their output
        self.ahead: dict[nn.Linear, tuple[torch.Tensor, Future[torch.Tensor]]] = {}

    @torch.no_grad()  # the gradient is _RealRowsLinear's
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """`x`'s real rows, then the zero rows."""
        flat = x.reshape(-1, x.shape[-1])
        out = flat.new_empty(self.packed_rows, flat.shape[1])
        torch.index_select(flat, 0, self.real, out=out[: len(self.real)])
        out[len(self.real) :] = 0
        return out

    def pack_shared(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`pack`, once for the projections that share an input."""
        if self._packed is None or self._packed[0] is not x:
            self._packed = (x, self.pack(x))
        return self._packed[1]

    def product(self, x: torch.Tensor, weight: torch.Tensor) -> Future[torch.Tensor]:
        """``F.linear(x, weight)`` on the real rows, unpacked, on this thread."""
        done: Future[torch.Tensor] = Future()
        done.set_result(_product(self.pack_shared(x), weight, self.unpack))
        return done


@torch.no_grad()  # grad mode is per thread: the worker's is on
def _product(packed: torch.Tensor, weight: torch.Tensor, unpack: torch.Tensor) -> torch.Tensor:
    return F.linear(packed, weight).index_select(0, unpack)


@torch.no_grad()  # grad mode is per thread: the worker's is on
def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """torch's own backward of F.linear's weight: the product over all rows."""
    return grad.reshape(-1, grad.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _WeightGrads:
    """The linear layers' weight gradients, computed on a second thread while the backward pass
    goes on: each is the same single-threaded SGEMM call, so the same bits. The backward pass
    waits for them at its end and sets them as autograd would have."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self.pool = pool
        self.pending: list[tuple[torch.Tensor, Future[torch.Tensor]]] = []

    def submit(self, weight: torch.Tensor, grad: torch.Tensor, x: torch.Tensor) -> None:
        """`grad` itself is held (not a view) so that autograd cannot add into it meanwhile."""
        if not self.pending:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self.pending.append((weight, self.pool.submit(_weight_grad, grad, x)))

    def finish(self) -> None:
        pending, self.pending = self.pending, []
        for weight, future in pending:
            grad = future.result()
            if weight.grad is None:
                weight.grad = grad
            else:
                weight.grad += grad

    def drop(self) -> None:
        """Forget what a backward pass that failed left (the next pass then waits for its own)."""
        self.pending = []


class _RealRowsLinear(torch.autograd.Function):
    """``F.linear(x, weight)`` computed on the real rows only (zeros on the pad rows)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        rows: _Rows,
        weight_grads: _WeightGrads,
        out: Future[torch.Tensor],
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.rows, ctx.weight_grads = rows, weight_grads
        return out.result().view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        rows: _Rows = ctx.rows
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = rows.pack(grad).mm(weight).index_select(0, rows.unpack).view(x.shape)
        if ctx.needs_input_grad[1]:
            ctx.weight_grads.submit(weight, grad, x)
        return grad_x, None, None, None, None


# Llama's projections that read the same input
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _handoffs(model: nn.Module) -> dict[nn.Linear, nn.Linear]:
    """For each group of projections of one input, its first (the first called) → its last."""
    handoff = {}
    for module in model.modules():
        for names in SHARED_INPUT:
            group = [getattr(module, name, None) for name in names]
            if all(isinstance(linear, nn.Linear) for linear in group):
                handoff[group[0]] = group[-1]
    return handoff


@contextmanager
def skip_padding(model: nn.Module, pad_id: int) -> Iterator[None]:
    """While open, every linear layer of `model` multiplies only the real rows of the batch
    (`input_ids` passed by keyword, right-padded with `pad_id`), some on a second thread, and
    `backward()` computes the weight gradients there, in `.grad` when the pass ends; restored on
    exit."""
    batch: list[_Rows] = []

    def on_call(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        batch[:] = [_Rows(kwargs["input_ids"], pad_id)]
        weight_grads.drop()

    def packed(linear: nn.Linear) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            rows = batch[0]
            if x.shape[:-1].numel() != rows.total or linear.bias is not None:
                raise RuntimeError("skip_padding: a linear layer saw other rows than the batch's")
            ahead = rows.ahead.pop(linear, None)
            if ahead is not None and ahead[0] is x:
                out = ahead[1]
            else:
                if linear in handoff:  # the same input's last projection, meanwhile on the worker
                    last = handoff[linear]
                    args = (rows.pack_shared(x), last.weight, rows.unpack)
                    rows.ahead[last] = (x, pool.submit(_product, *args))
                out = rows.product(x, linear.weight)
            return _RealRowsLinear.apply(x, linear.weight, rows, weight_grads, out)

        return forward

    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    handoff = _handoffs(model)
    threads = torch.get_num_threads()
    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,)) as pool:
        weight_grads = _WeightGrads(pool)
        hook = model.register_forward_pre_hook(on_call, with_kwargs=True)
        for linear in linears:
            linear.forward = packed(linear)
        try:
            yield
        finally:
            hook.remove()
            for linear in linears:
                del linear.forward
