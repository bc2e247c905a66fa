"""Surgery modules for training: fresh, seeded modules of the kinds in ``darts_correction``.

The math (paper sections 3.2, 3.4, appendix E) lives in :mod:`mergekit_darts.correction.darts_correction`,
the file every export ships, so training, ``apply_surgery``, an exported folder and the vLLM
plugin run one implementation.
"""

from __future__ import annotations

import torch

from mergekit_darts.correction.darts_correction import SurgeryModule, correction_module
from mergekit_darts.correction.spec import DEFAULT_MAX_POSITIONS, DEFAULT_RANK


def build_module(
    kind: str,
    hidden_size: int,
    rank: int = DEFAULT_RANK,
    max_positions: int = DEFAULT_MAX_POSITIONS,
    seed: int | None = None,
) -> SurgeryModule:
    """A fresh float32 module, the identity until trained; with ``seed`` its initial weights do
    not depend on the global RNG."""
    module = correction_module(kind, hidden_size, rank, max_positions)
    if seed is None:
        module.reset_parameters()
        return module
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module.reset_parameters()
    return module
