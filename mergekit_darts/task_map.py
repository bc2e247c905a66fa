"""Which surgery module serves which lm-eval task (the task map), in one place.

Each manifest task lists the lm-eval tasks it serves (``eval_tasks``, default its own name);
``surgery_map=gsm8k:math;humaneval:code`` overrides that. An exact name wins over glob patterns
(``mmlu_*``); a task two patterns claim is refused. ``hf-darts``, the sweep and the block's own
checks all use these functions.
"""

from __future__ import annotations

import fnmatch
import string
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from mergekit_darts.correction.darts_correction import ROUTED  # every task's module behind one gate
from mergekit_darts.errors import DoubleClaim, ModelArgsError, SurgeryFormatError

NONE = "none"  # no correction
AUTO = "auto"  # one module per request, chosen by its lm-eval task
JOINT = "joint"  # one plain correction fitted on every task (calibrate.joint)
RESERVED_TASK_NAMES = (
    NONE,
    AUTO,
    ROUTED,
    JOINT,
)  # values of hf-darts' ``surgery=`` with their own meaning
# hf-darts (HFLM) arguments that change the merged weights a surgery was calibrated on: refused
# with a surgery, by hf-darts and when a sweep is planned
OTHER_WEIGHTS = ("peft", "delta")
TASK_NAME_CHARACTERS = frozenset(string.ascii_letters + string.digits + "_.-")


def check_task_name(name: str) -> str:
    """A surgery task name, or ``ValueError``: it becomes a file name and a value inside
    lm-eval's comma-split ``--model_args``, and manifests travel with downloaded merges."""
    if not name or not name[0].isalnum() or not set(name) <= TASK_NAME_CHARACTERS:
        raise ValueError(
            f"{name!r} is not a valid task name; use letters, digits, '_', '.', '-' and "
            "start with a letter or digit"
        )
    if name.lower() in RESERVED_TASK_NAMES:
        raise ValueError(
            f"{name!r} is reserved by hf-darts (surgery=none|auto|routed|joint); rename it"
        )
    return name


def parse_surgery_map(value: str | Mapping[str, Any]) -> dict[str, str]:
    """``"gsm8k:math;humaneval:code"`` (or a dict) -> {lm-eval task or glob: surgery task | "none"}.

    Semicolons, because lm-eval splits ``--model_args`` on commas. A malformed value raises
    :class:`~mergekit_darts.errors.ModelArgsError`.
    """
    pairs: list[tuple[str, str]] = []
    if isinstance(value, Mapping):
        pairs = [(str(k).strip(), str(v).strip()) for k, v in value.items()]
    else:
        for entry in filter(None, (e.strip() for e in str(value).split(";"))):
            task, sep, target = (part.strip() for part in entry.partition(":"))
            if not (sep and task and target):
                raise ModelArgsError(
                    f"bad surgery_map entry {entry!r}: expected <lm-eval task>:<surgery task> "
                    f"pairs separated by ';', e.g. surgery_map=gsm8k:math;humaneval:code"
                )
            pairs.append((task, target))
    mapping: dict[str, str] = {}
    for task, target in pairs:
        if mapping.get(task, target) != target:
            raise ModelArgsError(f"surgery_map maps {task!r} twice ({mapping[task]}, {target})")
        mapping[task] = target
    if not mapping:
        raise ModelArgsError("surgery_map is empty; e.g. surgery_map=gsm8k:math;humaneval:code")
    return mapping


def eval_task_map(claims: Iterable[tuple[str, Sequence[str] | None]]) -> dict[str, str]:
    """{lm-eval task: surgery task} from (surgery task, its ``eval_tasks``) pairs.

    A task with no ``eval_tasks`` serves its own name. Each lm-eval task picks one module, so a
    second surgery task claiming it raises :class:`DoubleClaim`.
    """
    served: dict[str, str] = {}
    for name, eval_tasks in claims:
        for eval_task in eval_tasks or [name]:
            if served.get(eval_task, name) != name:
                raise DoubleClaim(eval_task, served[eval_task], name)
            served[eval_task] = name
    return served


class _Entry(Protocol):
    eval_tasks: list[str]


class _Tasks(Protocol):
    """What the task map reads of a manifest (``manifest.Manifest``, which imports this module)."""

    tasks: Mapping[str, _Entry]


def manifest_task_map(manifest: _Tasks) -> dict[str, str]:
    """{lm-eval task: surgery task} from each manifest task's ``eval_tasks`` (default: its name)."""
    claims = ((name, entry.eval_tasks) for name, entry in manifest.tasks.items())
    try:
        return eval_task_map(claims)
    except DoubleClaim as claim:
        raise SurgeryFormatError(
            f"lm-eval task {claim.eval_task!r} is served by surgery tasks {claim.first!r} "
            f"and {claim.second!r}: pass surgery_map= to choose"
        ) from None


def surgery_task_for(served: Mapping[str, str], task_name: str) -> str | None:
    """The surgery task of one lm-eval task: an exact entry wins over glob patterns (``mmlu_*``)."""
    if task_name in served:
        return served[task_name]
    hits = {target for pattern, target in served.items() if fnmatch.fnmatchcase(task_name, pattern)}
    if len(hits) > 1:
        raise ModelArgsError(
            f"lm-eval task {task_name!r} matches patterns of several surgery tasks "
            f"({', '.join(sorted(hits))}): add an exact surgery_map entry"
        )
    return hits.pop() if hits else None
