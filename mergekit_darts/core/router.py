"""Routing: one corrected model for every task, without the task id (DESIGN "Routing").

A gate reads each token's final hidden state and weighs the task corrections:
``g(h) = softmax(W h + b)`` over the router's tasks, plus a last "none" class (text that should get
no correction) when it was fitted with background data, and

    ``h_hat_t = h_t - sum_k g_k(h_t) * (c_k(h_t) + b_k[p_t])``

where ``c_k + b_k`` is task ``k``'s module correction (the "none" class adds nothing). Each token is
corrected from its own hidden state and position only, so the result is exact under batching,
padding, KV caches, chunked prefill and prefix caching, like a single module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from mergekit_darts.core.modules import SurgeryModule

NONE_CLASS = "none"  # the gate's last class when fitted with background text


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
        self.weight = nn.Parameter(torch.zeros(classes, hidden_size))
        self.bias = nn.Parameter(torch.zeros(classes))

    @property
    def classes(self) -> tuple[str, ...]:
        """Class names in gate order: the tasks, then "none" when fitted with background."""
        return self.tasks + ((NONE_CLASS,) if self.background else ())

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """``W h + b`` [..., K'] in float32."""
        return torch.nn.functional.linear(h.to(torch.float32), self.weight, self.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Gate probabilities [..., K'] in float32."""
        return torch.softmax(self.logits(h), dim=-1)

    def extra_repr(self) -> str:
        return f"tasks={list(self.tasks)}, background={self.background}"


class RoutedSurgery(nn.Module):
    """Every task's module behind one :class:`Router`: a drop-in for a single ``SurgeryModule``.

    ``corrections[k]`` is the module of ``router.tasks[k]`` (a list, not a dict: task names may
    hold dots, which module names may not). A module of kind ``none`` adds nothing.
    """

    kind = "routed"

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

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Corrected hidden state, computed in float32 and returned in ``h``'s dtype."""
        h32 = h.to(torch.float32)
        return (h32 - self.correction(h32, positions)).to(h.dtype)
