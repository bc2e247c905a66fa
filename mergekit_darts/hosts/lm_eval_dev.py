"""``select: {metric: lm_eval, dev: ...}``: the user's own benchmark judges the candidates.

Before any merge work, :func:`check_dev` loads each task's ``eval_tasks`` through lm-eval's own
``TaskManager`` and refuses, in one line, a dev split that the task does not have, that is the
split lm-eval evaluates (its ``test_split``, else ``validation_split``), or whose chosen documents
are evaluation documents (same ``doc_to_text``) or contain a calibration prompt of the task (the
n-gram rule of :mod:`mergekit_darts.overlap`, the one ``hf-darts``'s leakage check uses).

During training, :class:`LmEvalDev` scores the merged model that
:class:`~mergekit_darts.calibrate.dev.DevJudge` holds (one load, each candidate applied with
hooks) with lm-eval's ``simple_evaluate`` through an ``HFLM`` around that model object, with the
task set to evaluate the dev split and ``log_samples`` giving each document's outcome: the task's
first metric under its first filter, one item per distinct document however many of the tasks
read it. lm-eval is imported only here and only when called.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from mergekit_darts.calibrate.dev import DevOutcomes, per_document
from mergekit_darts.calibrate.pipeline import PreparedSurgery
from mergekit_darts.calibrate.runtime import merged_tokenizer
from mergekit_darts.config import ResolvedTask
from mergekit_darts.errors import SurgeryConfigError, SurgeryRunError
from mergekit_darts.overlap import NGRAM, CalibrationGrams

SNIPPET = 60  # characters of a document quoted in a refusal


def check_dev(prepared: PreparedSurgery, tokenizer_from: str) -> PreparedSurgery:
    """``prepared`` with every ``metric: lm_eval`` task's dev documents checked and ready to
    score (tasks already checked are kept). ``tokenizer_from`` is the model whose tokenizer
    finds calibration prompts in the documents: the base before a merge, the merged folder
    after it. Raises ``SurgeryConfigError``."""
    todo = [
        task for task in prepared.tasks if task.dev is not None and task.name not in prepared.dev
    ]
    if not todo:
        return prepared
    tokenizer = merged_tokenizer(tokenizer_from, prepared.config.trust_remote_code)
    scorers = dict(prepared.dev)
    for task in todo:
        scorers[task.name] = LmEvalDev.check(task, prepared.prompts[task.name].texts, tokenizer)
    return dataclasses.replace(prepared, dev=scorers)


@dataclass
class _Part:
    """One lm-eval task of a surgery task's ``eval_tasks``, set to evaluate its dev split."""

    name: str
    task: Any  # lm-eval's Task, its test_split now the dev split
    indices: list[int]  # the judging documents' positions in the dev split, ascending
    documents: list[str]  # each judging document's identity (_identity), in ``indices`` order
    metric: str  # its first metric: one value per document
    filter: str  # its first filter: the responses that metric reads
    evaluated: str  # the split lm-eval evaluates it on


class LmEvalDev:
    """A :class:`~mergekit_darts.calibrate.dev.DevScorer`: one surgery task's dev documents."""

    def __init__(self, split: str, parts: list[_Part], include_path: str | None) -> None:
        self.split, self.parts, self.include_path = split, parts, include_path
        self.metric = "/".join(dict.fromkeys(part.metric for part in parts))
        readings = sum(len(part.documents) for part in parts)
        distinct = len({identity for part in parts for identity in part.documents})
        names = ", ".join(part.name for part in parts)
        shared = (
            f" (read {readings} times: each document one item, the mean of its outcomes)"
            if readings > distinct
            else ""
        )
        self.description = f"the {distinct} {split} documents of {names}{shared}"
        self._lms: dict[tuple[int, int], Any] = {}

    @classmethod
    def check(cls, task: ResolvedTask, prompts: list[str], tokenizer: Any) -> LmEvalDev:
        """Load each of ``task``'s lm-eval tasks and check its dev documents; one line if not."""
        special = set(tokenizer.all_special_ids)
        grams = CalibrationGrams(_encode(tokenizer, prompts, special))
        parts = [
            _check_part(task, name, grams, lambda texts: _encode(tokenizer, texts, special))
            for name in task.eval_tasks
        ]
        return cls(task.dev.split, parts, task.dev.include_path)

    def record(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "include_path": self.include_path,
            "tasks": {
                part.name: {
                    "metric": part.metric,
                    "filter": part.filter,
                    "evaluated_split": part.evaluated,
                    "documents": len(part.indices),
                }
                for part in self.parts
            },
        }

    def score(self, model: nn.Module, batch_size: int) -> DevOutcomes:
        """lm-eval's per-document outcomes of ``model`` (as it is, hooks included), one item per
        distinct document however many of the tasks read it (:func:`per_document`)."""
        from lm_eval import simple_evaluate

        out = simple_evaluate(
            model=self._lm(model, batch_size),
            tasks=[part.task for part in self.parts],
            samples={part.name: part.indices for part in self.parts},
            bootstrap_iters=0,
            log_samples=True,
            task_manager=_manager(None, defaults=False),  # the tasks come loaded
        )
        readings = []
        for part in self.parts:
            logged = {
                s["doc_id"]: s for s in out["samples"][part.name] if s["filter"] == part.filter
            }
            for index, identity in zip(part.indices, part.documents, strict=True):
                value = logged[index][part.metric]
                if isinstance(value, bool):
                    value = float(value)
                if not isinstance(value, int | float):
                    raise SurgeryRunError(
                        f"lm-eval task {part.name!r} gives {part.metric} per document as "
                        f"{type(value).__name__}, not a number (a corpus-level metric): select "
                        "metric lm_eval needs a per-document score such as acc or exact_match"
                    )
                readings.append((f"{part.name}/{index}", identity, float(value)))
        return per_document(readings)

    def close(self) -> None:
        self._lms.clear()

    def _lm(self, model: nn.Module, batch_size: int) -> Any:
        """lm-eval's HF backend around the model object (its tokenizer from the model's folder,
        as ``lm_eval --model hf`` loads it), one per model and batch size."""
        from lm_eval.models.huggingface import HFLM

        key = (id(model), batch_size)
        if key not in self._lms:
            self._lms[key] = HFLM(pretrained=model, batch_size=batch_size)
        return self._lms[key]


def _check_part(
    task: ResolvedTask,
    name: str,
    grams: CalibrationGrams,
    encode: Callable[[list[str]], list[list[int]]],
) -> _Part:
    """lm-eval's task ``name`` set to evaluate ``task``'s dev split, its documents checked."""
    dev = task.dev
    key, eval_key = f"{task.select_key}.dev", f"{task.key}.eval_tasks"
    loaded = _load_task(name, dev.include_path, key, eval_key)
    config = loaded.config
    evaluated = config.test_split or config.validation_split
    if dev.split == evaluated:
        raise SurgeryConfigError(
            f"{key}.split: {dev.split!r} is the split lm-eval evaluates {name!r} on, and the dev "
            f"documents must be disjoint from the evaluation; name another split of it "
            f"({', '.join(s for s in loaded.dataset if s != evaluated) or 'it has no other'})"
        )
    if dev.split not in loaded.dataset:
        raise SurgeryConfigError(
            f"{key}.split: lm-eval task {name!r} has no split {dev.split!r} (it has "
            f"{', '.join(loaded.dataset)}); name one it is not evaluated on"
        )
    higher = loaded.higher_is_better()
    metric = next(iter(higher))
    if not higher[metric]:
        raise SurgeryConfigError(
            f"{eval_key}: the first metric of lm-eval task {name!r}, {metric}, is lower-is-better; "
            "select metric lm_eval needs a per-document score where higher is better (acc, "
            "exact_match)"
        )
    evaluation = {_normal(_text(loaded, doc)): i for i, doc in enumerate(loaded.eval_docs)}
    loaded.set_config("test_split", dev.split)  # what lm-eval evaluates from now on: the dev split
    docs = loaded.eval_docs
    if dev.indices is not None:
        past = [i for i in dev.indices if i >= len(docs)]
        if past:
            raise SurgeryConfigError(
                f"{key}.indices: document {past[0]} is past the end of {name!r}'s {dev.split} "
                f"split ({len(docs)} documents, numbered from 0)"
            )
        indices = sorted(set(dev.indices))
    else:
        indices = list(range(min(dev.limit or len(docs), len(docs))))
    if not indices:
        raise SurgeryConfigError(f"{key}.split: {name!r}'s {dev.split} split has no documents")
    where = f"document {{}} of {name!r}'s {dev.split} split"
    texts = {index: _text(loaded, docs[index]) for index in indices}
    for index, text in texts.items():
        same = evaluation.get(_normal(text))
        if same is not None:
            raise SurgeryConfigError(
                f"{key}: {where.format(index)} ({_snippet(text)}) is evaluation document "
                f"{same} of its {evaluated} split; dev items must not be evaluated items: leave "
                "it out (dev.indices) or name a split disjoint from the evaluation"
            )
    wholes = [  # input and answer: a calibration prompt may hold either
        f"{text}{config.target_delimiter}{_target(loaded, docs[index])}"
        for index, text in texts.items()
    ]
    for (index, text), ids in zip(texts.items(), encode(wholes), strict=True):
        prompt = grams.found(ids)
        if prompt is not None:
            raise SurgeryConfigError(
                f"{key}: {where.format(index)} ({_snippet(text)}) contains calibration prompt "
                f"{prompt} of task {task.name!r} ({NGRAM}-token overlap); the candidates "
                "would be judged on what they trained on: leave it out (dev.indices) or "
                "calibrate on other prompts"
            )
    first_filter = loaded._filters[0].name  # the filter ensembles lm-eval built (no public name)
    documents = [_identity(docs[index]) for index in indices]
    return _Part(name, loaded, indices, documents, metric, first_filter, evaluated)


def _load_task(name: str, include_path: str | None, key: str, eval_key: str) -> Any:
    """lm-eval's task ``name``: from ``include_path`` when it is there, else lm-eval's own."""
    manager = None
    if include_path is not None:
        folder = Path(include_path)
        if not folder.is_dir():
            raise SurgeryConfigError(
                f"{key}.include_path: {include_path} is not a folder (of lm-eval task YAMLs, "
                "resolved from the working directory)"
            )
        manager = _manager(str(folder.resolve()), defaults=False)
    if manager is None or name not in manager.all_subtasks:
        manager = _manager(None, defaults=True)
    if name not in manager.all_subtasks:
        what = (
            "a group or tag; list its tasks" if name in manager.all_tasks else "not an lm-eval task"
        )
        raise SurgeryConfigError(
            f"{eval_key}: {name!r} is {what} (select metric lm_eval scores each of eval_tasks"
            + (
                "; a task of your own: dev.include_path names its folder)"
                if include_path is None
                else ")"
            )
        )
    try:
        return manager.load([name])["tasks"][name]
    except Exception as err:  # its dataset cannot be read, a template does not render, ...
        detail = " ".join(f"{type(err).__name__}: {err}".split())[:300]
        raise SurgeryConfigError(
            f"{eval_key}: lm-eval could not load task {name!r} ({detail}); select metric lm_eval "
            "reads its documents before merging"
        ) from err


@functools.cache
def _manager(include_path: str | None, *, defaults: bool) -> Any:
    """lm-eval's task index (the one over its own tasks takes seconds: built once a process)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=defaults)


def _encode(tokenizer: Any, texts: list[str], special: set[int]) -> list[list[int]]:
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [[t for t in ids if t not in special] for ids in encoded]


def _text(task: Any, doc: Any) -> str:
    """A document's input as lm-eval builds it (the whole document where that is not text)."""
    text = task.doc_to_text(doc)
    return text if isinstance(text, str) else json.dumps(doc, sort_keys=True, default=str)


def _identity(doc: Any) -> str:
    """A document's identity: sha256 of its content as the task yields it, so tasks reading the
    same split of the same data (gsm8k, gsm8k_cot) name each of its documents alike."""
    text = json.dumps(doc, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _target(task: Any, doc: Any) -> str:
    """A document's answer as text (a multiple-choice index as its choice)."""
    target = task.doc_to_target(doc)
    if isinstance(target, int) and task.config.doc_to_choice is not None:
        choices = task.doc_to_choice(doc)
        return str(choices[target]) if 0 <= target < len(choices) else ""
    if isinstance(target, list):
        return " ".join(map(str, target))
    return str(target)


def _normal(text: str) -> str:
    return " ".join(text.split())


def _snippet(text: str) -> str:
    flat = _normal(text)
    return repr(flat if len(flat) <= SNIPPET else flat[:SNIPPET] + "…")
