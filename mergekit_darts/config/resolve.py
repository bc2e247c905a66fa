"""Each task as it will run: the block's defaults filled in, select and holdout settled.

The block sets defaults, a task overrides them (:data:`~mergekit_darts.config.schema.OVERRIDABLE`),
and a select candidate overrides the task. A :class:`ResolvedTask` keeps where each setting came
from, so messages name the key the user wrote (``surgery.tasks[1].lr``, not ``surgery.lr``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mergekit_darts.config.schema import (
    DEFAULT_HOLDOUT,
    LM_EVAL,
    OVERRIDABLE,
    PLAIN_CANDIDATES,
    VERDICT_METRICS,
    CalibrationConfig,
    Candidate,
    DevSplit,
    SelectConfig,
    SurgeryConfig,
    TaskConfig,
)
from mergekit_darts.correction.darts_correction import PLAIN_KINDS
from mergekit_darts.correction.losses import LOGIT_LOSSES
from mergekit_darts.correction.spec import plain_kind_problem
from mergekit_darts.errors import SurgeryConfigError

# how to leave the default selection, for the messages about it
DEFAULT_SELECT_HINT = "(the default selection; `select: off` trains one module on every prompt)"


@dataclass(frozen=True)
class ResolvedTask:
    """A task with every default filled in and its key path, for messages."""

    index: int
    name: str
    target: str  # as written in the YAML (recorded in the manifest)
    eval_tasks: tuple[str, ...]
    calibration: CalibrationConfig
    module: str
    loss: str
    rank: int
    max_positions: int
    steps: int
    lr: float
    batch_size: int
    seed: int
    loss_positions: str
    overridden: frozenset[str]  # settings the task sets itself
    holdout: float = 0.0  # fraction of prompts held out from training (0: none)
    holdout_key: str = ""  # where the holdout was set, for messages
    folds: int = 0  # cross-fitting folds of the selection (0: none; then holdout may hold out)
    select: SelectConfig | None = None
    select_key: str = ""
    select_default: bool = False  # no select, module or loss written: the default selection
    default_candidates: bool = False  # the select candidates are the defaults, none written
    # the merge's architecture, once known (prepare_surgery): default candidates its engines
    # would lose (correction.spec.plain_kind_problem) are left out
    model_type: str | None = None

    @property
    def key(self) -> str:
        return f"surgery.tasks[{self.index}]"

    def candidates(self) -> list[ResolvedTask]:
        """The task as each select candidate trains it (no select: the task itself); with a
        verdict metric ``{module: none}`` first when the block does not list it."""
        if self.select is None:
            return [self]
        candidates = self.select.candidates
        if self.default_candidates:
            candidates = [
                c for c in candidates if plain_kind_problem(c.module, self.model_type) is None
            ]
        tested = self.verdict or self.dev is not None
        if tested and all(c.module != "none" for c in candidates):
            candidates = [Candidate(module="none"), *candidates]  # the verdict's baseline
        return [self.as_candidate(c) for c in candidates]

    def as_candidate(self, candidate: Candidate) -> ResolvedTask:
        """The task with one select candidate's settings over its own."""
        return dataclasses.replace(
            self,
            select=None,
            select_default=False,
            overridden=self.overridden | set(candidate.model_fields_set),
            **candidate.model_dump(exclude_none=True),
        )

    @property
    def needs_logits(self) -> bool:
        """True when training or selection compares the two models' next-token distributions
        (kl, ce, select by agreement or kl). The verdict's completion metrics compare the merge's
        top-1 token with the target's completion tokens: the merged head alone, any vocabulary."""
        metric = self.select is not None and self.select.metric in ("agreement", "kl")
        return metric or any(c.loss in LOGIT_LOSSES for c in self.candidates())

    @property
    def verdict(self) -> bool:
        """Whether selection is decided on the target's completions of the held-out prompts."""
        return self.select is not None and self.select.metric in VERDICT_METRICS

    @property
    def dev(self) -> DevSplit | None:
        """With ``metric: lm_eval``, the lm-eval split that judges the candidates."""
        return (
            self.select.dev if self.select is not None and self.select.metric == LM_EVAL else None
        )

    @property
    def needs_head(self) -> bool:
        """Capture the output heads: logits are needed, or held-out agreement / KL are reported."""
        return self.needs_logits or self.holdout > 0 or self.folds > 0

    def source_key(self, setting: str) -> str:
        """Key path where ``setting`` was set: the task's override or the block default."""
        return f"{self.key}.{setting}" if setting in self.overridden else f"surgery.{setting}"


def resolve_tasks(config: SurgeryConfig) -> list[ResolvedTask]:
    """Fill each task's unset settings from the block's defaults."""
    resolved = []
    for index, task in enumerate(config.tasks):
        settings = {
            name: getattr(config, name) if getattr(task, name) is None else getattr(task, name)
            for name in OVERRIDABLE
        }
        resolved.append(
            ResolvedTask(
                index=index,
                name=task.name,
                target=task.target,
                eval_tasks=tuple(task.eval_tasks or [task.name]),
                calibration=task.calibration,
                overridden=frozenset(n for n in OVERRIDABLE if getattr(task, n) is not None),
                **settings,
                **_selection(config, task, f"surgery.tasks[{index}]"),
            )
        )
    return resolved


def default_select(config: SurgeryConfig) -> SelectConfig:
    """The default selection: its candidates, or only the plain ones under ``plain: true``."""
    if config.plain:
        return SelectConfig(candidates=[Candidate(**c) for c in PLAIN_CANDIDATES])
    return SelectConfig()


def _selection(config: SurgeryConfig, task: TaskConfig, key: str) -> dict[str, Any]:
    """A task's select and holdout: its own values win over the block's.

    With no ``select`` anywhere and no ``module`` or ``loss`` set (block or task), the task runs
    the default selection (``SelectConfig()``); ``select: off`` or an explicit module or
    loss trains that one module on every prompt (the paper's recipe).
    """
    for level, where in ((task, key), (config, "surgery")):
        if level.select and level.holdout is not None and level.select.metric == LM_EVAL:
            raise SurgeryConfigError(_no_holdout(f"{where}.holdout", f"{where}.select"))
        if level.select and level.holdout is not None:
            raise SurgeryConfigError(
                f"{where}.holdout: {where}.select.holdout sets the held-out fraction here; "
                "give it in one place"
            )
    if task.select is not None:
        select, select_key = task.select or None, f"{key}.select"
    elif config.select is not None:
        select, select_key = config.select or None, "surgery.select"
    elif _chooses_own_module(config, task):
        select, select_key = None, ""
    else:
        select, select_key = default_select(config), "surgery.select"
    default = select is not None and task.select is None and config.select is None
    defaults = select is not None and (default or "candidates" not in select.model_fields_set)
    if select is not None and (select.metric == LM_EVAL or select.dev is not None):
        _check_dev(select, select_key, task, key)
        return {  # every candidate trains on every prompt: the dev split judges
            "holdout": 0.0,
            "holdout_key": f"{select_key}.dev",
            "select": select,
            "select_key": select_key,
            "select_default": False,
            "default_candidates": defaults,
        }
    holdout_given = (
        task.holdout is not None
        or (default and config.holdout)
        or (select is not None and select.holdout is not None)
    )
    if select is not None and select.folds is not None:
        explicit = "folds" in select.model_fields_set
        if explicit or not holdout_given:
            _check_folds(select, select_key, task, key)
            return {
                "holdout": 0.0,  # every prompt is judged once, by the folds
                "holdout_key": f"{select_key}.folds",
                "folds": select.folds,
                "select": select,
                "select_key": select_key,
                "select_default": default,
                "default_candidates": defaults,
            }
    if task.holdout is not None:
        holdout, holdout_key = task.holdout, f"{key}.holdout"
    elif select is not None and not (default and config.holdout):
        holdout, holdout_key = select.holdout or DEFAULT_HOLDOUT, f"{select_key}.holdout"
    else:
        holdout, holdout_key = config.holdout or 0.0, "surgery.holdout"
    return {
        "holdout": holdout,
        "holdout_key": holdout_key,
        "select": select,
        "select_key": select_key if select is not None else "",
        "select_default": default,
        "default_candidates": defaults,
    }


def _check_folds(select: SelectConfig, select_key: str, task: TaskConfig, key: str) -> None:
    """Cross-fitting judges every prompt, so no share is held out and the kept one is refit."""
    if select.holdout is not None:
        raise SurgeryConfigError(
            f"{select_key}: holdout and folds both say which prompts judge the candidates; give "
            "folds (every prompt judged once) or holdout (one share), not both"
        )
    if task.holdout is not None:
        raise SurgeryConfigError(
            f"{key}.holdout: {select_key}.folds already judges every prompt once; remove the "
            "holdout"
        )
    if not select.refit:
        raise SurgeryConfigError(
            f"{select_key}.refit: false keeps the module trained on part of the prompts, but "
            "with folds each candidate is trained once per fold; remove refit: false (the kept "
            "settings are refit on every prompt) or use holdout instead of folds"
        )


def _check_dev(select: SelectConfig, select_key: str, task: TaskConfig, key: str) -> None:
    """``metric: lm_eval`` and ``dev`` go together, on a task that names its lm-eval tasks; the
    dev split judges, so no calibration prompt is held out for it."""
    if select.dev is None:
        raise SurgeryConfigError(
            f"{select_key}.dev: metric lm_eval scores the candidates with lm-eval on a "
            "development split of the task's eval_tasks; add dev: {split: <split name>} (e.g. "
            "gsm8k's train), never the split lm-eval evaluates"
        )
    if select.metric != LM_EVAL:
        raise SurgeryConfigError(
            f"{select_key}.dev: a development split is read by metric lm_eval only (now "
            f"{select.metric}); set metric: lm_eval or remove dev"
        )
    if select.dev.indices is not None and select.dev.limit is not None:
        raise SurgeryConfigError(
            f"{select_key}.dev: indices and limit both choose the dev documents; give one"
        )
    for setting in ("holdout", "folds"):
        if setting in select.model_fields_set:
            raise SurgeryConfigError(
                f"{select_key}.{setting}: with metric lm_eval the dev split judges the "
                f"candidates and each trains on every calibration prompt; remove {setting}"
            )
    if task.holdout is not None:
        raise SurgeryConfigError(_no_holdout(f"{key}.holdout", select_key))
    if task.eval_tasks is None:
        raise SurgeryConfigError(
            f"{key}.eval_tasks: metric lm_eval ({select_key}) scores the candidates on the "
            "lm-eval tasks this module serves; list them, e.g. eval_tasks: [gsm8k]"
        )


def _no_holdout(holdout_key: str, select_key: str) -> str:
    return (
        f"{holdout_key}: with metric lm_eval ({select_key}) the dev split judges the candidates "
        "and each trains on every calibration prompt; remove the holdout"
    )


def check_folds(task: ResolvedTask, num_prompts: int) -> None:
    """Each fold must hold a prompt and leave one to train on; run once the prompts are read."""
    folds = task.folds
    if folds and folds > num_prompts:
        hint = f" {DEFAULT_SELECT_HINT}" if task.select_default else ""
        raise SurgeryConfigError(
            f"{task.select_key}.folds: {folds} folds need at least {folds} calibration prompts, "
            f"and task {task.name!r} has {num_prompts}; lower folds or give more prompts{hint}"
        )


def _chooses_own_module(config: SurgeryConfig, task: TaskConfig) -> bool:
    """Whether the block or the task names a module or a loss (then no default selection)."""
    named = {"module", "loss"}
    return bool(named & config.model_fields_set) or any(getattr(task, n) is not None for n in named)


def route_tasks(config: SurgeryConfig) -> list[str]:
    """The tasks ``route:`` weighs, in gate order: its ``tasks``, else every task of the block."""
    if config.route is None:
        return []
    return list(config.route.tasks or [task.name for task in config.tasks])


def check_route_holdout(config: SurgeryConfig, num_prompts: dict[str, int]) -> None:
    """``route.holdout`` must leave a prompt on each side for every class (task name or "none"
    for the background) of ``num_prompts``; run once the prompts are read."""
    fraction = config.route.holdout
    for name, n in num_prompts.items():
        held = holdout_count(fraction, n)
        if held >= n:
            what = "the background" if name == "none" else f"task {name!r}"
            raise SurgeryConfigError(
                f"surgery.route.holdout: {fraction} of the {n} prompt(s) of {what} holds out "
                f"{held}, leaving none to fit the router on; give it at least 2 prompts or lower "
                "the fraction"
            )


def holdout_count(fraction: float, n: int) -> int:
    """Prompts held out of ``n``: ``round(fraction * n)``, at least one when holding out at all."""
    return 0 if fraction <= 0 else max(1, round(fraction * n))


def check_holdout(task: ResolvedTask, num_prompts: int) -> None:
    """The split must leave a prompt on each side; run once the prompts are read."""
    held = holdout_count(task.holdout, num_prompts)
    if held and held >= num_prompts:
        hint = f" {DEFAULT_SELECT_HINT}" if task.select_default else ""
        raise SurgeryConfigError(
            f"{task.holdout_key}: {task.holdout} of {num_prompts} prompt(s) holds out {held}, "
            f"leaving no prompt to train on; lower it or give more calibration prompts{hint}"
        )


# what the joint correction's tasks share: it is one correction, judged one way on all of them
JOINT_SHARED = ("metric", "alpha", "refit")


@dataclass(frozen=True)
class JointPlan:
    """The joint correction a block fits: its tasks, its candidates (plain kinds, each with its
    loss) and how the verdict judges them (the tasks' shared ``select`` settings)."""

    tasks: tuple[str, ...]
    candidates: tuple[tuple[str, str], ...]  # (module, loss), in the first task's order
    metric: str
    alpha: float
    refit: bool


def plan_joint(config: SurgeryConfig, tasks: list[ResolvedTask]) -> JointPlan | None:
    """The block's joint correction (calibrate.joint), or None.

    ``joint:`` written and not possible is refused in one line naming why; without ``joint:`` it
    is planned over every task whenever it is possible (two or more tasks, a plain candidate
    common to all, the verdict judging them alike), silently otherwise; ``joint: off`` never.
    """
    if config.joint is False or (config.joint is None and len(tasks) < 2):
        return None
    written = config.joint is not None
    named = joint_tasks(config)
    chosen = [task for task in tasks if task.name in named]
    plain = [[(c.module, c.loss) for c in t.candidates() if _closed_form(c)] for t in chosen]
    common = tuple(c for c in plain[0] if all(c in other for other in plain[1:]))
    why = None
    if not common:
        why = (
            f"no plain candidate ({', '.join(PLAIN_KINDS)}, under l1 or ewl1) is common to its "
            "tasks; add one to each task's select candidates, or set plain: true"
        )
    why = why or _judged_apart(chosen)
    if why is None:
        select = chosen[0].select
        return JointPlan(tuple(named), common, select.metric, select.alpha, select.refit)
    if written:
        raise SurgeryConfigError(f"surgery.joint: cannot fit a joint correction: {why}")
    return None


def _closed_form(candidate: ResolvedTask) -> bool:
    """A plain kind under a loss the closed-form fit solves (``l1``, ``ewl1``): the joint
    correction sums those fits' statistics."""
    return candidate.module in PLAIN_KINDS and candidate.loss not in LOGIT_LOSSES


def joint_tasks(config: SurgeryConfig) -> list[str]:
    """The tasks ``joint:`` names, else every task of the block, in block order."""
    if config.joint:
        return list(config.joint.tasks or [task.name for task in config.tasks])
    return [task.name for task in config.tasks]


def _judged_apart(tasks: list[ResolvedTask]) -> str | None:
    """Why the verdict cannot judge one correction on every one of ``tasks``, or None."""
    for task in tasks:
        if not task.verdict:
            return (
                f"task {task.name!r} is not judged by the completion verdict, which judges the "
                "joint correction; give it a select with a completion_* metric"
            )
    first = tasks[0]
    for task in tasks[1:]:
        for name in JOINT_SHARED:
            if getattr(task.select, name) != getattr(first.select, name):
                return (
                    f"tasks {first.name!r} and {task.name!r} differ in select {name}; the joint "
                    "correction is judged one way on all of its tasks"
                )
        if (task.folds, task.holdout) != (first.folds, first.holdout):
            return (
                f"tasks {first.name!r} and {task.name!r} split their prompts differently (folds, "
                "holdout); the joint correction is cross-fitted on the same splits of each"
            )
    return None
