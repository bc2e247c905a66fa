"""Which surgery module serves which lm-eval task: the routing rule, in one place.

Each manifest task lists the lm-eval tasks it serves (``eval_tasks``, default its own name);
``surgery_map=gsm8k:math;humaneval:code`` overrides that. An exact name wins over glob patterns
(``mmlu_*``); a task two patterns claim is refused. ``hf-darts``, the sweep and the block's own
checks all use these functions.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

from mergekit_darts.errors import SurgeryFormatError

NONE = "none"  # no correction
AUTO = "auto"  # one module per request, chosen by its lm-eval task
RESERVED_TASK_NAMES = (NONE, AUTO)  # values of hf-darts' ``surgery=`` with their own meaning


def parse_surgery_map(value: str | Mapping[str, Any]) -> dict[str, str]:
    """``"gsm8k:math;humaneval:code"`` (or a dict) -> {lm-eval task or glob: surgery task | "none"}.

    Semicolons, because lm-eval splits ``--model_args`` on commas.
    """
    pairs: list[tuple[str, str]] = []
    if isinstance(value, Mapping):
        pairs = [(str(k).strip(), str(v).strip()) for k, v in value.items()]
    else:
        for entry in filter(None, (e.strip() for e in str(value).split(";"))):
            task, sep, target = (part.strip() for part in entry.partition(":"))
            if not (sep and task and target):
                raise ValueError(
                    f"bad surgery_map entry {entry!r}: expected <lm-eval task>:<surgery task> "
                    f"pairs separated by ';', e.g. surgery_map=gsm8k:math;humaneval:code"
                )
            pairs.append((task, target))
    mapping: dict[str, str] = {}
    for task, target in pairs:
        if mapping.get(task, target) != target:
            raise ValueError(f"surgery_map maps {task!r} twice ({mapping[task]}, {target})")
        mapping[task] = target
    if not mapping:
        raise ValueError("surgery_map is empty; e.g. surgery_map=gsm8k:math;humaneval:code")
    return mapping


def manifest_routes(manifest: Mapping[str, Any]) -> dict[str, str]:
    """{lm-eval task: surgery task} from each manifest task's ``eval_tasks`` (default: its name)."""
    routes: dict[str, str] = {}
    for name, entry in manifest["tasks"].items():
        for eval_task in entry.get("eval_tasks") or [name]:
            if routes.get(eval_task, name) != name:
                raise SurgeryFormatError(
                    f"lm-eval task {eval_task!r} is served by surgery tasks {routes[eval_task]!r} "
                    f"and {name!r}: pass surgery_map= to choose"
                )
            routes[eval_task] = name
    return routes


def route(routes: Mapping[str, str], task_name: str) -> str | None:
    """The surgery task of one lm-eval task: an exact entry wins over glob patterns (``mmlu_*``)."""
    if task_name in routes:
        return routes[task_name]
    hits = {target for pattern, target in routes.items() if fnmatch.fnmatchcase(task_name, pattern)}
    if len(hits) > 1:
        raise ValueError(
            f"lm-eval task {task_name!r} matches patterns of several surgery tasks "
            f"({', '.join(sorted(hits))}): add an exact surgery_map entry"
        )
    return hits.pop() if hits else None
