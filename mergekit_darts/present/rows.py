"""The numbers a run's card and its terminal summary both show, formatted once: a value or "–",
the loss a module trained with, what ``select`` kept in one line, the router's and the joint
correction's rows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mergekit_darts.folder.manifest import RouterEntry, TaskEntry


def number(value: float | None, form: str = ".3f") -> str:
    """``value`` in ``form``, or "–" where the manifest holds none."""
    return "–" if value is None else format(value, form)


def loss_label(entry: TaskEntry) -> str:
    """The loss a module trained with; ``none`` trains nothing."""
    return "–" if entry.module == "none" else str(entry.loss)


def verdict_line(task: str, entry: TaskEntry, *, card: bool) -> str | None:
    """What ``select`` kept, in one line: the held-out verdict (calibrate.verdict) where there is
    one, else a line only when ``none`` won."""
    selection = entry.selection or {}
    if "verdict" in selection:
        return f"{task}: {selection['verdict']}"
    if not none_won(entry):
        return None
    if card:
        return f"For `{task}`, no correction (the merge as it is) won: its module is the identity."
    return (
        f"{task}: no correction (the merge as it is) won on the held-out {selection['metric']}; "
        "its module is the identity"
    )


def none_won(entry: TaskEntry) -> bool:
    """Whether ``select`` kept the ``none`` candidate (the merge as it is)."""
    selection = entry.selection
    return bool(selection) and selection["candidates"][selection["chosen"]]["module"] == "none"


def router_rows(router: RouterEntry) -> list[tuple[str, str, str, str, str]]:
    """(class, prompts, tokens, token accuracy, sequence accuracy): every class, then all."""
    held = router.held_out or {}
    rows = [
        (
            name,
            str(m["prompts"]),
            str(m["tokens"]),
            number(m["token_accuracy"]),
            number(m["sequence_accuracy"]),
        )
        for name, m in held.get("per_task", {}).items()
    ]
    if held:
        rows.append(
            (
                "all",
                str(held["prompts"]),
                str(held["tokens"]),
                number(held["token_accuracy"]),
                number(held["sequence_accuracy"]),
            )
        )
    return rows


def joint_results(selection: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, Any]]]:
    """(candidate label, task, its result on the task) for every joint candidate and task."""
    return [
        (f"{c['module']} + {c['loss']}", task, result)
        for c in selection.get("candidates", [])
        for task, result in c.get("tasks", {}).items()
    ]
