"""Surgery modules: small corrections of the final hidden state (paper sections 3.2, 3.4, appendix E).

Every module maps the merged model's final hidden state ``h`` [..., H] and each token's absolute
position ``p`` [...] to a corrected state ``h_hat = h - correction(h, p)``. ``W_up`` (``up``) starts
at zero, so a fresh module is the identity. Positions below zero (padding) or at/after
``max_positions`` get no position term: a position table learned on short prompts says nothing
about positions it never saw.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

MODULE_KINDS = ("standard", "pos_corr", "add", "parallel", "none")


class SurgeryModule(nn.Module):
    """Content bottleneck ``c(h) = W_up ReLU(W_down h)``; subclasses add a position term."""

    kind: ClassVar[str] = "standard"

    def __init__(self, hidden_size: int, rank: int = 16, max_positions: int = 512):
        super().__init__()
        if hidden_size <= 0 or rank <= 0 or max_positions <= 0:
            raise ValueError(
                f"hidden_size, rank and max_positions must be positive, got "
                f"{hidden_size}, {rank}, {max_positions}"
            )
        self.hidden_size = hidden_size
        self.rank = rank
        self.max_positions = max_positions
        self.down = nn.Linear(hidden_size, rank, bias=False)  # Kaiming-uniform (nn.Linear default)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)

    def content(self, h: torch.Tensor) -> torch.Tensor:
        return self.up(torch.relu(self.down(h)))

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.content(h)

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Corrected hidden state, computed in float32 and returned in ``h``'s dtype."""
        h32 = h.to(torch.float32)
        return (h32 - self.correction(h32, positions)).to(h.dtype)

    def _position_rows(self, table: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Rows of a [T_max, H] table for each position; zero outside ``[0, max_positions)``."""
        if positions is None:
            raise ValueError(f"the {self.kind!r} surgery module needs token positions")
        inside = (positions >= 0) & (positions < self.max_positions)
        rows = table[positions.clamp(0, self.max_positions - 1)]
        return rows * inside.unsqueeze(-1).to(rows.dtype)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, hidden_size={self.hidden_size}, rank={self.rank}, " + (
            f"max_positions={self.max_positions}"
        )


class StandardSurgery(SurgeryModule):
    """Yang et al. (2024): position-agnostic, ``h_hat = h - c(h)``."""

    kind = "standard"


class PositionCorrection(SurgeryModule):
    """DARTS: ``h_hat = h - c(h) - b_p`` with a free, zero-initialised bias per position."""

    kind = "pos_corr"

    def __init__(self, hidden_size: int, rank: int = 16, max_positions: int = 512):
        super().__init__(hidden_size, rank, max_positions)
        self.position_bias = nn.Parameter(torch.zeros(max_positions, hidden_size))

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.content(h) + self._position_rows(self.position_bias, positions)


class _PositionEmbedding(SurgeryModule):
    """Shared parameter of the appendix E variants: a learned embedding ``e_p`` per position."""

    def __init__(self, hidden_size: int, rank: int = 16, max_positions: int = 512):
        super().__init__(hidden_size, rank, max_positions)
        # Not zero: in ``parallel`` a zero e_p would leave the position path without gradient.
        self.position_embedding = nn.Parameter(torch.randn(max_positions, hidden_size) * 0.02)


class AddPosition(_PositionEmbedding):
    """Appendix E "Add": ``h_hat = h - W_up ReLU(W_down (h + e_p))``."""

    kind = "add"

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        return self.content(h + self._position_rows(self.position_embedding, positions))


class ParallelPosition(_PositionEmbedding):
    """Appendix E "Parallel": a second bottleneck on ``e_p`` whose output is added to ``c(h)``."""

    kind = "parallel"

    def __init__(self, hidden_size: int, rank: int = 16, max_positions: int = 512):
        super().__init__(hidden_size, rank, max_positions)
        self.position_down = nn.Linear(hidden_size, rank, bias=False)
        self.position_up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.zeros_(self.position_up.weight)

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        e = self._position_rows(self.position_embedding, positions)
        return self.content(h) + self.position_up(torch.relu(self.position_down(e)))


class NoCorrection(SurgeryModule):
    """``module: none``: the merge as it is, ``h_hat = h``. No parameters, nothing to train.

    A ``select`` candidate like any other, so a task whose corrections all hurt on held-out
    prompts keeps the uncorrected merge: surgery is never worse than no surgery on what it measured.
    """

    kind = "none"

    def __init__(self, hidden_size: int, rank: int = 16, max_positions: int = 512):
        nn.Module.__init__(self)
        if hidden_size <= 0 or rank <= 0 or max_positions <= 0:
            raise ValueError(
                f"hidden_size, rank and max_positions must be positive, got "
                f"{hidden_size}, {rank}, {max_positions}"
            )
        self.hidden_size, self.rank, self.max_positions = hidden_size, rank, max_positions

    def content(self, h: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(h)

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return h


_KINDS: dict[str, type[SurgeryModule]] = {
    cls.kind: cls
    for cls in (StandardSurgery, PositionCorrection, AddPosition, ParallelPosition, NoCorrection)
}


def build_module(
    kind: str, hidden_size: int, rank: int = 16, max_positions: int = 512, seed: int | None = None
) -> SurgeryModule:
    """Create a fresh float32 module; with ``seed`` the initial weights do not depend on global RNG."""
    if kind not in _KINDS:
        raise ValueError(
            f"unknown surgery module {kind!r}; choose one of {', '.join(MODULE_KINDS)}"
        )
    if seed is None:
        return _KINDS[kind](hidden_size, rank, max_positions)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _KINDS[kind](hidden_size, rank, max_positions)
