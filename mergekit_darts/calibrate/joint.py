"""The joint correction: one plain correction for every task of a block, with no task id.

With two or more tasks whose candidates include a plain kind (``head``, ``norm``: they fold into
the checkpoint's own tensors, so any engine serves them), one correction of each plain kind is
fitted on every task's captures at once: the closed-form fit (``calibrate.plain_fit``) of the
tasks' statistics summed. It is judged as a task's correction is, cross-fitted on each task's
own splits: the fit of split ``k`` uses every task's training rows of split ``k`` and scores
each task's judged rows of split ``k``. :func:`~mergekit_darts.calibrate.verdict.decide_joint`
keeps it only when it beats ``none`` over every task's prompts and is worse than ``none`` on no
task; then it is refitted on every prompt and written as ``surgery/joint.safetensors``
(``hf-darts`` ``surgery=joint``, ``export --joint``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from mergekit_darts.calibrate.choose import TaskRun
from mergekit_darts.calibrate.plain_fit import PlainStatistics, plain_statistics, solve
from mergekit_darts.calibrate.selection import cross_fit_splits, holdout_split
from mergekit_darts.calibrate.train import in_rows
from mergekit_darts.calibrate.verdict import JOINT_TEST, cross_fitted_scores, decide_joint
from mergekit_darts.config import JointPlan, ResolvedTask
from mergekit_darts.correction.darts_correction import SurgeryModule
from mergekit_darts.correction.modules import build_module
from mergekit_darts.task_map import NONE


@dataclass(frozen=True)
class FittedJoint:
    """The kept joint correction (kind ``none`` when none was kept) and its manifest entry."""

    module: SurgeryModule
    entry: dict[str, Any]


def fit_joint(plan: JointPlan, tasks: list[ResolvedTask], runs: list[TaskRun]) -> FittedJoint:
    """Every joint candidate cross-fitted and judged on every task; the kept one refitted.

    ``tasks`` are the block's tasks as resolved (each run's own may since be its chosen
    candidate); ``runs`` hold their captures, completions and the verdict's scores of ``none``.
    Only the tasks the plan names take part.
    """
    start = time.perf_counter()
    picked = [i for i, task in enumerate(tasks) if task.name in plan.tasks]
    tasks, runs = [tasks[i] for i in picked], [runs[i] for i in picked]
    splits = [_splits(task, len(run.sequences)) for task, run in zip(tasks, runs, strict=True)]
    entries, fits = [], []
    for module, loss in plan.candidates:
        owned = [_candidate(task, module, loss) for task in tasks]
        fold_modules = [
            _fit(owned, runs, [rows[k][0] for rows in splits]) for k in range(len(splits[0]))
        ]
        fits.append((owned, fold_modules))
        verdict = {
            task.name: cross_fitted_scores(
                fold_modules, run.held_completions, _order(task, run), [j for _, j in rows]
            )[plan.metric]
            for task, run, rows in zip(tasks, runs, splits, strict=True)
        }
        entries.append({**_settings(owned[0]), "verdict": verdict})
    none = {
        task.name: _none_scores(run, plan.metric) for task, run in zip(tasks, runs, strict=True)
    }
    labels = [f"{module} + {loss}" for module, loss in plan.candidates]
    decision = decide_joint(entries, labels, none, plan.metric, plan.alpha)
    if decision.chosen < 0:
        kept = build_module(NONE, runs[0].merged.hidden.shape[-1])
        spec = {"module": NONE, "rank": tasks[0].rank, "max_positions": tasks[0].max_positions}
    else:
        owned, fold_modules = fits[decision.chosen]
        kept = _fit(owned, runs, [None] * len(runs)) if plan.refit else fold_modules[0]
        spec = {
            **_settings(owned[0]),
            "rank": owned[0].rank,
            "max_positions": owned[0].max_positions,
        }
    selection = {
        "metric": plan.metric,
        "alpha": plan.alpha,
        "test": JOINT_TEST,
        "refit": plan.refit,
        "candidates": entries,
        "chosen": decision.chosen,
        "verdict": decision.line,
    }
    entry = {
        **spec,
        "tasks": [task.name for task in tasks],
        "selection": selection,
        "timings": {"fit_s": round(time.perf_counter() - start, 3)},
    }
    return FittedJoint(kept.eval(), entry)


def _candidate(task: ResolvedTask, module: str, loss: str) -> ResolvedTask:
    """The task's own candidate of that kind and loss (its loss positions, sizes, seed)."""
    return next(c for c in task.candidates() if (c.module, c.loss) == (module, loss))


def _settings(candidate: ResolvedTask) -> dict[str, Any]:
    return {"module": candidate.module, "loss": candidate.loss}


def _splits(task: ResolvedTask, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The task's (training rows, judged rows) per split, as its own selection drew them."""
    if task.folds:
        return cross_fit_splits(n, task.folds, task.seed)
    return [holdout_split(n, task.holdout, task.seed)]


def _order(task: ResolvedTask, run: TaskRun) -> list[int]:
    """The prompt of each row of the task's held-out completions (``fit.judged_rows``)."""
    n = len(run.sequences)
    return list(range(n)) if task.folds else holdout_split(n, task.holdout, task.seed)[1].tolist()


def _fit(
    owned: list[ResolvedTask], runs: list[TaskRun], rows: list[torch.Tensor | None]
) -> SurgeryModule:
    """One module of ``owned``'s kind, solved from every task's statistics on its ``rows``
    (None: all of its sequences) summed."""
    first = owned[0]
    hidden = runs[0].merged.hidden.shape[-1]
    module = build_module(first.module, hidden, first.rank, first.max_positions, seed=first.seed)
    module = module.to(runs[0].merged.hidden.device)
    total: PlainStatistics | None = None
    for candidate, run, picked in zip(owned, runs, rows, strict=True):
        counted = run.loss_mask(candidate) & run.merged.mask.cpu()
        if picked is not None:
            counted = in_rows(counted, picked)
        counted = counted.to(run.merged.hidden.device)
        stats = plain_statistics(module, run.merged, run.target, counted, candidate.loss)
        total = stats if total is None else total + stats
    solve(module, total)
    return module


def _none_scores(run: TaskRun, metric: str) -> list[float | None]:
    """``none``'s verdict scores of the task, as its own selection measured them."""
    entry = next(e for e in run.selection["candidates"] if e["module"] == NONE)
    return entry["verdict"][metric]
