"""Calibration leakage: lm-eval requests that contain the calibration prompts of their module.

Under ``surgery=routed`` every request meets every routed task's module, so it is checked against
the calibration prompts of all of them.

The paper keeps calibration and evaluation disjoint (its Table 7); a module scored on the prompts
it was fitted to is not held out. ``hf-darts`` checks every request against the token ids the
surgery run stored in ``surgery/diagnostics/<task>.safetensors``, the way lm-eval's
decontamination does (n-gram overlap, n = 13): a request overlaps when it contains 13 consecutive
tokens of a calibration sequence, or the whole of a shorter one that ``max_length`` did not cut
(the first few tokens of a cut prompt say little about it: with ``max_length: 3`` every prompt
would be two words, found in many unrelated requests). Whether a prompt may have been cut is read
from the manifest: its ``calibration.prompt_tokens`` reached ``max_length - continuation_tokens``
(so nothing new is stored, and older folders read as before). Special
tokens (BOS, padding) are dropped on both sides, because calibration and lm-eval add them
differently. Each distinct context is encoded and scanned once (multiple-choice documents share
one across their choices), so the check costs about one tokenizer pass per document and a set
lookup per token (measured in the README).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lm_eval.api.instance import Instance

from mergekit_darts.errors import SurgeryFormatError
from mergekit_darts.folder.artifacts import read_manifest
from mergekit_darts.folder.diagnostics import diagnostics_path, read_token_ids
from mergekit_darts.overlap import NGRAM, CalibrationGrams
from mergekit_darts.task_map import JOINT, ROUTED

log = logging.getLogger(__name__)


def calibration_sequences(path: Path, drop: set[int]) -> list[list[int]]:
    """Each stored calibration sequence's real token ids, without ``drop`` (special tokens)."""
    try:
        ids, mask = read_token_ids(path)
    except SurgeryFormatError as err:
        raise SurgeryFormatError(
            f"{err}: the leakage check reads it; re-run `mergekit-darts calibrate` on this "
            "folder, or delete the file to evaluate without the check"
        ) from None
    return [
        [t for t in row[keep].tolist() if t not in drop]
        for row, keep in zip(ids, mask, strict=True)
    ]


def possibly_cut(calibration: dict[str, Any], rows: int) -> list[bool]:
    """Per stored row: whether its prompt reached its token budget (and so may have been cut).

    Reads the manifest's ``calibration`` record; a prompt exactly as long as the budget cannot be
    told from a cut one and counts as cut. Without ``prompt_tokens`` (older manifests) or with a
    row count that does not match, nothing is marked.
    """
    lengths = calibration.get("prompt_tokens")
    max_length = calibration.get("max_length")
    if not isinstance(lengths, list) or len(lengths) != rows or not isinstance(max_length, int):
        return []
    budget = max_length - int(calibration.get("continuation_tokens") or 0)
    return [isinstance(n, int) and n >= budget for n in lengths]


def _pair(request: Instance) -> tuple[str, str]:
    """(context, continuation) of any request type; generation and rolling have no continuation."""
    args = request.args
    text = args[0] if args and isinstance(args[0], str) else ""
    more = args[1] if len(args) > 1 and isinstance(args[1], str) else ""
    return text, more


class LeakageCheck:
    """Per lm-eval task: how many requests contain calibration prompts of the module serving it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.counts: dict[str, int] = {}  # lm-eval task -> overlapping requests
        self.seconds = 0.0  # time spent checking, for the record
        self._special = set(tokenizer.all_special_ids)
        self._grams: dict[tuple[Path, str], CalibrationGrams | None] = {}

    def check(
        self, requests: list[Instance], folder: Path, module_of: Callable[[str], str | None]
    ) -> None:
        """Count and warn (once per task) for ``requests``; ``module_of`` names each task's module."""
        started = time.perf_counter()
        by_task: dict[str, list[Instance]] = defaultdict(list)
        for request in requests:
            if request.task_name:
                by_task[request.task_name].append(request)
        for task, group in by_task.items():
            module = module_of(task)
            grams = self._load(folder, module) if module else None
            if grams is None:
                continue
            pairs = [_pair(request) for request in group]
            encoded = self._encode({text for pair in pairs for text in pair if text})
            seen: dict[str, bool] = {}  # a context is shared by every choice of its document
            found = 0
            for context, continuation in pairs:
                head = encoded.get(context, [])
                if context not in seen:
                    seen[context] = grams.found_in(head)
                # windows across the join: the context's last n - 1 tokens and the continuation
                found += seen[context] or bool(
                    continuation and grams.found_in(head[1 - NGRAM :] + encoded[continuation])
                )
            if found and not self.counts.get(task):
                log.warning(
                    "hf-darts: %d of %d requests of lm-eval task %s contain calibration prompts "
                    "of surgery module %r (%d-token overlap); calibration and evaluation should "
                    "be disjoint (paper, Table 7), so this score is not held out",
                    found,
                    len(group),
                    task,
                    module,
                    NGRAM,
                )
            self.counts[task] = self.counts.get(task, 0) + found
        self.seconds += time.perf_counter() - started

    def _encode(self, texts: set[str]) -> dict[str, list[int]]:
        distinct = sorted(texts)
        if not distinct:  # every document empty: a tokenizer cannot take an empty batch
            return {}
        encoded = self.tokenizer(distinct, add_special_tokens=False)["input_ids"]
        return {
            text: [t for t in ids if t not in self._special]
            for text, ids in zip(distinct, encoded, strict=True)
        }

    def _load(self, folder: Path, module: str) -> CalibrationGrams | None:
        """The n-grams of ``module``'s calibration prompts; under ``routed``, of every task the
        router weighs (each request meets all of their modules); under ``joint``, of every task
        it was fitted on."""
        key = (folder, module)
        if key not in self._grams:
            manifest = read_manifest(folder)
            routed = module == ROUTED and manifest.router is not None
            names = manifest.router.tasks if routed else [module]
            if module == JOINT and manifest.joint is not None:
                names = manifest.joint.tasks
            grams: CalibrationGrams | None = None
            for name in names:
                entry = manifest.tasks.get(name)
                path = diagnostics_path(folder, entry)
                if path is None:
                    log.info(
                        "hf-darts: no calibration diagnostics for %r: leakage not checked", name
                    )
                    continue
                found = calibration_sequences(path, self._special)
                task = CalibrationGrams(found, cut=possibly_cut(entry.calibration, len(found)))
                if grams is None:
                    grams = task
                else:
                    grams.update(task)
            self._grams[key] = grams
        return self._grams[key]
