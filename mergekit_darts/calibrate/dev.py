"""``select: {metric: lm_eval}``: each candidate scored on a development split by lm-eval itself.

The scoring (lm-eval's task, its documents and metric) lives outside this layer
(:mod:`mergekit_darts.hosts.lm_eval_dev`), behind :class:`DevScorer`; this module holds
the merged model for it. The merged model is loaded once, after the captures, and each candidate's
trained module is applied to it in memory with :class:`~mergekit_darts.apply.SurgeryHandle`
hooks (the plain model for ``none``), so no candidate reloads a model.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from mergekit_darts.apply import SurgeryHandle
from mergekit_darts.calibrate.runtime import LazyModel, Runtime, stage
from mergekit_darts.calibrate.store import StoreStats
from mergekit_darts.correction.darts_correction import SurgeryModule


@dataclass(frozen=True)
class DevOutcomes:
    """One candidate's per-item scores on the dev documents, in one fixed order: one item per
    distinct document (:func:`per_document`)."""

    items: list[str]  # "<lm-eval task>/<document index in the dev split>", "+"-joined when shared
    values: list[float]


def per_document(readings: Iterable[tuple[str, str, float]]) -> DevOutcomes:
    """One item per distinct document, its outcome the mean of its readings.

    ``readings``: (label, document identity, outcome) per document each lm-eval task scored.
    The verdict's exact test pairs items that are independent under its null; two tasks that
    read the same document (gsm8k and gsm8k_cot on gsm8k's train split) score it twice, with
    outcomes that move together, and counted as two items they would let a correction pass
    more often than ``alpha``. Items keep the order of their first reading.
    """
    documents: dict[str, list[tuple[str, float]]] = {}
    for label, identity, value in readings:
        documents.setdefault(identity, []).append((label, value))
    return DevOutcomes(
        ["+".join(label for label, _ in read) for read in documents.values()],
        [sum(value for _, value in read) / len(read) for read in documents.values()],
    )


class DevScorer(Protocol):
    """Scores a model on one surgery task's dev documents (``integrations.lm_eval_dev``)."""

    metric: str  # what one item's value is, as the verdict line names it
    description: str  # which documents, as the verdict line names them ("the 200 train ...")

    def score(self, model: nn.Module, batch_size: int) -> DevOutcomes: ...

    def record(self) -> dict[str, Any]:
        """The manifest's ``selection.dev``: which split, documents and metric judged."""
        ...

    def close(self) -> None:
        """Let go of every model it scored (so the judge's release frees its memory)."""
        ...


class DevJudge:
    """The merged model, loaded on first use and kept for every task's candidates."""

    def __init__(
        self,
        merged: str,
        runtime: Runtime,
        scorers: Mapping[str, DevScorer],
        stats: StoreStats,
    ) -> None:
        self.scorers = scorers
        self._model = LazyModel(merged, "the merged model (dev scoring)", runtime, stats)
        self._handle: SurgeryHandle | None = None

    def outcomes(
        self, task: str, module: SurgeryModule | None, batch_size: int, timings: dict[str, float]
    ) -> DevOutcomes:
        """The scores of the merged model corrected by ``module`` (None: as it is)."""
        model = self._model.get(task, timings, "load_dev_model_s")
        if self._handle is None:
            self._handle = SurgeryHandle(model, None)
        self._handle.module = None if module is None else module.eval()
        try:
            with (
                stage(task, "scoring a select candidate with lm-eval on the dev split"),
                _callers_random_state(),
            ):
                return self.scorers[task].score(model, batch_size)
        finally:
            self._handle.module = None

    def close(self) -> None:
        """Take the hooks off and drop the model (the scorers' references to it too)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for scorer in self.scorers.values():
            scorer.close()
        self._model.close()


@contextmanager
def _callers_random_state() -> Iterator[None]:
    """lm-eval seeds Python's, NumPy's and torch's global generators: give the caller's back."""
    python, numpy = random.getstate(), np.random.get_state()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
        yield
    random.setstate(python)
    np.random.set_state(numpy)
