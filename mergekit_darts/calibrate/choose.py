"""The train phase of one task: its module, or each ``select`` candidate scored on held-out prompts.

:class:`TaskRun` is one task's working state between the phases: the pipeline fills in its
captures, :func:`train_task` its module and held-out numbers, and
:mod:`mergekit_darts.calibrate.write` turns it into files. The loop that trains one module on
cached states is :func:`mergekit_darts.calibrate.train.train_surgery`; this module decides which
modules to train, on which sequences, and what is recorded about them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.calibrate.collect import logits_need
from mergekit_darts.calibrate.data import Prompts
from mergekit_darts.calibrate.dev import DevJudge
from mergekit_darts.calibrate.runtime import Runtime, stage, timer
from mergekit_darts.calibrate.selection import (
    HeldOut,
    candidate_label,
    choose,
    cross_fit_splits,
    cross_fitted_metrics,
    held_out_metrics,
    holdout_split,
)
from mergekit_darts.calibrate.train import (
    TrainResult,
    TrainSettings,
    in_rows,
    measure_bias,
    train_stacked,
    train_surgery,
)
from mergekit_darts.calibrate.verdict import (
    DEV_TEST,
    VERDICT_TEST,
    HeldOutCompletions,
    Wording,
    cross_fitted_scores,
    decide,
    mean,
)
from mergekit_darts.config import OVERRIDABLE, ResolvedTask
from mergekit_darts.config.schema import LM_EVAL, default
from mergekit_darts.correction.darts_correction import SurgeryModule
from mergekit_darts.correction.modules import build_module
from mergekit_darts.errors import HeadError, SurgeryRunError
from mergekit_darts.messages import exponent_form

LOG = logging.getLogger("mergekit_darts")
DEFAULT_LR = exponent_form(default("lr"))  # as the docs write it, for messages


@dataclass
class TaskRun:
    """Working state of one task between the phases."""

    task: ResolvedTask
    prompts: Prompts
    prompt_ids: list[list[int]]
    sequences: list[list[int]] = field(default_factory=list)
    completions: list[list[int]] | None = None
    completion_mask: torch.Tensor | None = None
    target: Captured | None = None
    merged: Captured | None = None
    result: TrainResult | None = None
    delta_all: tuple[torch.Tensor, torch.Tensor] | None = None  # before/after, every real token
    timings: dict[str, float] = field(default_factory=dict)
    train_rows: torch.Tensor | None = None  # sequences the saved module trained on (None: all)
    held_rows: torch.Tensor | None = None  # sequences held out from training
    held_out: dict[str, Any] | None = None  # manifest `held_out`
    selection: dict[str, Any] | None = None  # manifest `selection`
    held_completions: HeldOutCompletions | None = None  # held-out prompts + target completions

    def loss_mask(self, task: ResolvedTask | None = None) -> torch.Tensor:
        """[N, T] bool on the CPU: the real tokens the loss and rho_L1 cover."""
        real = self.merged.mask.cpu()
        positions = (task or self.task).loss_positions
        return real if positions == "all" else real & self.completion_mask

    def trained(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` [N, T] limited to the sequences the saved module trained on."""
        return mask if self.train_rows is None else in_rows(mask, self.train_rows)

    def held_sha256(self) -> list[str]:
        """The sha256 of each held-out prompt, in the order they were held out."""
        return [self.prompts.sha256[i] for i in self.held_rows.tolist()]


def settings_of(task: ResolvedTask) -> dict[str, Any]:
    """The task's training settings by the schema's names: a new setting is added there only."""
    return {key: getattr(task, key) for key in OVERRIDABLE}


def require_completion_tokens(run: TaskRun) -> None:
    """``loss_positions: completion`` needs at least one completion token to train on."""
    if run.task.loss_positions == "completion" and not run.completion_mask.any():
        raise SurgeryRunError(
            f"surgery task {run.task.name!r}: the target ended every completion at once (EOS "
            "first), so loss_positions: completion has no token to train on; use "
            "loss_positions: all"
        )


def train_task(run: TaskRun, runtime: Runtime, dev: DevJudge | None = None) -> None:
    """Train the task's module; with ``holdout`` measure it on held-out prompts, with ``select``
    train every candidate on the rest and keep the best (refit on every prompt unless refit off);
    with ``metric: lm_eval`` every candidate trains on every prompt and ``dev`` judges it."""
    task = run.task
    if task.needs_logits:
        _require_heads(run)
    with stage(task.name, "training"), timer(run.timings, "train_s"):
        if task.holdout:
            run.train_rows, run.held_rows = holdout_split(
                len(run.sequences), task.holdout, task.seed
            )
        if task.dev is not None:
            chosen, run.result = _select_on_dev(run, runtime, dev)
            run.task, module = chosen, run.result.module
        elif task.select is not None:
            chosen, module = _select(run, runtime)
            run.task = chosen
            if task.select.refit:
                run.train_rows = None
                with timer(run.timings, "refit_s"):
                    run.result = _converged(run, chosen, _fit(run, chosen, runtime, None))
        else:
            run.result = _converged(run, task, _fit(run, task, runtime, run.train_rows))
            module = run.result.module
        if run.held_rows is not None:
            run.held_out = _held_out_entry(run, module, saved=run.train_rows is not None)
        before, after, _ = measure_bias(run.result.module, run.merged, run.target, run.merged.mask)
        run.delta_all = (before, after)


def _fit(
    run: TaskRun, task: ResolvedTask, runtime: Runtime, rows: torch.Tensor | None
) -> TrainResult:
    """One module with ``task``'s settings, on the sequences ``rows`` (None: all)."""
    settings, where = _training(run, task, runtime)
    return train_surgery(_module(run, task), run.merged, run.target, settings, rows=rows, **where)


def _fit_splits(
    run: TaskRun, task: ResolvedTask, runtime: Runtime, rows: list[torch.Tensor | None]
) -> list[TrainResult]:
    """One module with ``task``'s settings per set of training rows (one per fold).

    On a GPU the folds train together (:func:`~mergekit_darts.calibrate.train.train_stacked`):
    a step of one module there costs about a kernel launch per operation, so K modules in one
    batched step cost little more than one. On the CPU one after another: a step there is
    bound by memory traffic, which stacking multiplies (docs/benchmarks.md).
    """
    if len(rows) == 1 or torch.device(runtime.device).type != "cuda":
        return [_fit(run, task, runtime, r) for r in rows]
    settings, where = _training(run, task, runtime)
    modules = [_module(run, task) for _ in rows]
    return train_stacked(modules, run.merged, run.target, settings, rows, **where)


def _module(run: TaskRun, task: ResolvedTask) -> SurgeryModule:
    hidden = run.merged.hidden.shape[-1]
    return build_module(task.module, hidden, task.rank, task.max_positions, seed=task.seed)


def _training(run: TaskRun, task: ResolvedTask, runtime: Runtime) -> tuple[TrainSettings, dict]:
    """``task``'s optimisation settings and the keyword arguments every training call takes."""
    settings = TrainSettings(task.loss, task.steps, task.lr, task.batch_size, task.seed)
    loss_mask = None if task.loss_positions == "all" else run.loss_mask(task).to(runtime.device)
    desc = f"{run.task.name}: " + (
        "measure none" if task.module == "none" else f"train {task.module} + {task.loss}"
    )
    where = {"loss_mask": loss_mask, "device": runtime.device, "progress": runtime.progress}
    return settings, {**where, "desc": desc}


def _converged(run: TaskRun, task: ResolvedTask, result: TrainResult) -> TrainResult:
    """``result``, unless its training diverged: then one line saying so and what to lower."""
    reason = result.divergence()
    if reason is None:
        return result
    raise SurgeryRunError(
        f"surgery task {run.task.name!r}: training diverged ({reason}); lower lr (now "
        f"{task.lr:g}, default {DEFAULT_LR}); the merged model and any existing surgery/ folder "
        "are unchanged"
    )


def judged_rows(task: ResolvedTask, n: int) -> torch.Tensor:
    """The prompts the selection judges, of ``n``: every one with folds, else the held-out share
    (the split training uses: ``holdout_split`` of the task's count and seed)."""
    if task.folds:
        return torch.arange(n)
    return holdout_split(n, task.holdout, task.seed)[1]


def _splits(run: TaskRun) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(training rows, judged rows) per fit of a candidate: one per fold, or the one split."""
    task = run.task
    if not task.folds:
        return [(run.train_rows, run.held_rows)]
    return cross_fit_splits(len(run.sequences), task.folds, task.seed)


def _select(run: TaskRun, runtime: Runtime) -> tuple[ResolvedTask, SurgeryModule]:
    """Every candidate trained on each split's training rows, scored on its judged rows; returns
    the best candidate and its module (with folds, the first fold's: the refit replaces it).

    The score covers the task's loss positions; with completions each candidate is also
    measured on the completion tokens alone (recorded, not used for the choice). With a verdict
    metric the choice is :func:`~mergekit_darts.calibrate.verdict.decide`'s, on the target's
    completions of the judged prompts (``none`` unless a correction passes). A candidate
    whose training diverged (on any fold) is left out of the choice, with a warning and its
    reason recorded as ``diverged`` in its manifest entry (its numbers are null); if every one
    did, the run stops.
    """
    task, select = run.task, run.task.select
    splits = _splits(run)
    candidates = task.candidates()
    with timer(run.timings, "select_fits_s"):
        fits = [_fit_splits(run, c, runtime, [train for train, _ in splits]) for c in candidates]
    reasons = [next((r for fit in f if (r := fit.divergence()) is not None), None) for f in fits]
    converged = [f for f, reason in zip(fits, reasons, strict=True) if reason is None]
    with timer(run.timings, "select_metrics_s"):
        measured = iter(_judged_metrics(run, converged, splits) if converged else [])
    verdict_s = 0.0
    entries = []
    for candidate, candidate_fits, reason in zip(candidates, fits, reasons, strict=True):
        if reason is not None:
            entries.append(_diverged(task, candidate, reason))
            continue
        held = next(measured)
        final = [fit.final_loss for fit in candidate_fits]
        entry = {**settings_of(candidate), "held_out": held, "final_loss": final[0]}
        if len(candidate_fits) > 1:
            entry["final_loss"] = final  # one per fold
        if run.held_completions is not None:
            started = time.perf_counter()
            entry["verdict"] = _verdict_scores(run, candidate_fits, splits)
            verdict_s += time.perf_counter() - started
            held.update({name: mean(values) for name, values in entry["verdict"].items()})
        entries.append(entry)
    if run.held_completions is not None:
        run.timings["select_verdict_s"] = verdict_s
    results = [f[0] for f in fits]
    _require_one_converged(task, candidates, entries)
    decision = None
    if run.held_completions is None:
        chosen = choose([e["held_out"][select.metric] for e in entries], select.metric)
    else:
        labels = [candidate_label(e, entries) for e in entries]
        decision = decide(entries, labels, select.metric, select.alpha)
        chosen = decision.chosen
    run.selection = {"metric": select.metric, **_judged_record(run, splits)}
    run.selection.update(refit=select.refit, candidates=entries, chosen=chosen)
    if decision is not None:
        run.selection.update(
            completion_tokens=select.completion_tokens,
            alpha=select.alpha,
            test=VERDICT_TEST,
            detectable=decision.detectable,
            verdict=decision.line,
        )
    run.result = results[chosen]
    return candidates[chosen], results[chosen].module


# the token metrics of a candidate not measured on tokens (diverged, or judged by lm-eval)
NO_TOKEN_METRICS = dict.fromkeys(("agreement", "kl", "rho_l1"))


def _diverged(task: ResolvedTask, candidate: ResolvedTask, reason: str) -> dict[str, Any]:
    """The manifest entry of a candidate whose training diverged, after a warning saying so."""
    LOG.warning(
        "surgery task %r: select candidate %s + %s (lr %g) diverged (%s); left out of the choice",
        task.name,
        candidate.module,
        candidate.loss,
        candidate.lr,
        reason,
    )
    return {**settings_of(candidate), "held_out": dict(NO_TOKEN_METRICS), "diverged": reason}


def _require_one_converged(
    task: ResolvedTask, candidates: list[ResolvedTask], entries: list[dict[str, Any]]
) -> None:
    """One line when every candidate's training diverged: nothing to choose from."""
    if all("diverged" in e for e in entries):
        raise SurgeryRunError(
            f"surgery task {task.name!r}: training diverged for every select candidate "
            f"({entries[0]['diverged']}, ...); lower lr (now "
            f"{', '.join(sorted({f'{c.lr:g}' for c in candidates}))}, default {DEFAULT_LR}); "
            "the merged model and any existing surgery/ folder are unchanged"
        )


def _select_on_dev(
    run: TaskRun, runtime: Runtime, dev: DevJudge | None
) -> tuple[ResolvedTask, TrainResult]:
    """``metric: lm_eval``: every candidate trained on every prompt, applied to the merged model
    in memory and scored by lm-eval on the dev documents; ``decide`` keeps one (``none`` unless a
    correction passes the paired exact test over the items). No refit: each trained on all."""
    task, select = run.task, run.task.select
    if dev is None or task.name not in dev.scorers:
        raise SurgeryRunError(
            f"surgery task {task.name!r}: select metric lm_eval needs its dev split checked "
            "before the run (mergekit_darts.run_surgery and mergekit-yaml do this); "
            "the merged model and any existing surgery/ folder are unchanged"
        )
    scorer = dev.scorers[task.name]
    candidates, results, entries = task.candidates(), [], []
    items: list[str] | None = None
    for candidate in candidates:
        fit = _fit(run, candidate, runtime, None)
        results.append(fit)
        reason = fit.divergence()
        if reason is not None:
            entries.append(_diverged(task, candidate, reason))
            continue
        module = None if candidate.module == "none" else fit.module
        scored = dev.outcomes(task.name, module, task.batch_size, run.timings)
        items = scored.items
        entries.append(
            {
                **settings_of(candidate),
                "held_out": {**NO_TOKEN_METRICS, LM_EVAL: mean(scored.values)},
                "final_loss": fit.final_loss,
                "verdict": {LM_EVAL: scored.values},
            }
        )
    _require_one_converged(task, candidates, entries)
    labels = [candidate_label(e, entries) for e in entries]
    binary = all(v in (0.0, 1.0) for e in entries for v in e.get("verdict", {}).get(LM_EVAL, []))
    wording = Wording(
        name=scorer.metric,
        judged="dev",
        unit="items",
        where=scorer.description,
        test="McNemar" if binary else "signed-rank",
    )
    decision = decide(entries, labels, LM_EVAL, select.alpha, wording)
    run.selection = {
        "metric": LM_EVAL,
        "dev": {**scorer.record(), "items": items},
        "refit": False,  # every candidate trained on every prompt: the saved module is the kept one
        "candidates": entries,
        "chosen": decision.chosen,
        "alpha": select.alpha,
        "test": DEV_TEST if binary else VERDICT_TEST,
        "detectable": decision.detectable,
        "verdict": decision.line,
    }
    return candidates[decision.chosen], results[decision.chosen]


def _judged_record(run: TaskRun, splits: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Which prompts judged the candidates, by sha256: the held-out share, or every fold."""
    sha = run.prompts.sha256
    if not run.task.folds:
        return {"holdout": run.task.holdout, "holdout_sha256": run.held_sha256()}
    return {
        "folds": run.task.folds,
        "fold_sha256": [[sha[i] for i in judged.tolist()] for _, judged in splits],
    }


def _judged_metrics(
    run: TaskRun,
    fits: list[list[TrainResult]],
    splits: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[dict[str, Any]]:
    """The selection metrics of each candidate (its fits, one per split) on its judged rows,
    pooled over folds: on its loss positions, and on the completion tokens alone when there are
    completions. All candidates are measured together, sharing the head passes of the merge and
    the target."""
    judged = [rows for _, rows in splits]

    def pooled(mask: torch.Tensor) -> list[HeldOut] | None:
        folds = [
            ([candidate[fold].module for candidate in fits], in_rows(mask, rows))
            for fold, rows in enumerate(judged)
        ]
        if not any(counted.any() for _, counted in folds):
            return None
        return cross_fitted_metrics(folds, run.merged, run.target)

    held = [h.summary() for h in pooled(run.loss_mask())]  # one set for all
    if run.completion_mask is not None:
        completion = pooled(run.merged.mask & run.completion_mask.to(run.merged.mask.device))
        if completion is not None:
            for entry, measured in zip(held, completion, strict=True):
                entry["completion"] = measured.summary()
    return held


def _verdict_scores(
    run: TaskRun, fits: list[TrainResult], splits: list[tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, list[float | None]]:
    """Per judged prompt (in the order of ``run.held_completions``), each fold's module scoring
    the prompts it did not train on."""
    order = judged_rows(run.task, len(run.sequences)).tolist()
    modules = [fit.module for fit in fits]
    return cross_fitted_scores(modules, run.held_completions, order, [j for _, j in splits])


def _held_out_entry(run: TaskRun, module: SurgeryModule, *, saved: bool) -> dict[str, Any]:
    """Manifest ``held_out``: metrics before/after on every held-out token and on completions."""
    real = run.merged.mask
    sets = {"all": real}
    if run.completion_mask is not None:
        sets["completion"] = real & run.completion_mask.to(real.device)
    measured: dict[str, HeldOut] = {
        name: held_out_metrics(module, run.merged, run.target, in_rows(mask, run.held_rows))
        for name, mask in sets.items()
        if in_rows(mask, run.held_rows).any()
    }
    return {
        "fraction": run.task.holdout,
        "prompt_sha256": run.held_sha256(),
        "saved_module": saved,  # false: the numbers are the chosen candidate's, before its refit
        **{name: held.as_dict() for name, held in measured.items()},
    }


def _require_heads(run: TaskRun) -> None:
    """kl, ce, select by agreement or KL need logits the model really produces: one line if not."""
    task = run.task
    what = logits_need(task)
    try:
        for captured in (run.target, run.merged):
            captured.head.require(what)
    except HeadError as err:
        raise SurgeryRunError(f"surgery task {task.name!r}: {err}") from None
