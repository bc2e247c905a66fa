"""The calibration pipeline: check a block, capture every task, train, write ``surgery/``.

Phases, in order: :func:`prepare_surgery` runs every check that needs no weights;
:func:`capture_tasks` collects each task's target and merged captures
(:mod:`~mergekit_darts.calibrate.collect`: one model in memory at a time, one load per distinct
model, none for what the store holds); :func:`calibrate` then trains each task's module
(:mod:`~mergekit_darts.calibrate.choose`) and writes ``surgery/``
(:mod:`~mergekit_darts.calibrate.write`). Nothing is written until every task has succeeded, and
then ``surgery/`` appears in one rename, so a failure leaves the merged folder as it was.
``on_phase(name)`` lets a caller wrap each phase ("target", "merged", "train") in a context of
its own (the benchmarks time them and track memory peaks).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.calibrate.choose import (
    TaskRun,
    judged_rows,
    require_completion_tokens,
    train_task,
)
from mergekit_darts.calibrate.collect import (
    Calibration,
    capture_merged,
    capture_target,
    group_by_target,
)
from mergekit_darts.calibrate.continuation import saved_eos_token_ids
from mergekit_darts.calibrate.data import (
    Prompts,
    calibration_ids,
    load_prompts,
    read_prompts,
    tokenize_prompts,
)
from mergekit_darts.calibrate.dev import DevJudge, DevScorer
from mergekit_darts.calibrate.fit_router import FittedRouter, fit_router, route_classes
from mergekit_darts.calibrate.joint import fit_joint
from mergekit_darts.calibrate.runtime import Runtime, merged_tokenizer, stage
from mergekit_darts.calibrate.store import CaptureStore, check_cache_dir
from mergekit_darts.calibrate.verdict import HeldOutCompletions, completion_reference
from mergekit_darts.calibrate.write import calibration_record, write_surgery
from mergekit_darts.config import (
    JointPlan,
    ResolvedTask,
    SurgeryConfig,
    calibration_file,
    check_folds,
    check_holdout,
    check_output,
    check_route_holdout,
    check_targets,
    model_shape,
    parse_surgery,
    plan_joint,
    prompt_file,
    read_surgery_file,
    resolve_tasks,
    route_tasks,
)
from mergekit_darts.correction.darts_correction import NONE_CLASS
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.folder.fs import inside, same_path
from mergekit_darts.folder.identity import weights_identity
from mergekit_darts.folder.manifest import Manifest, surgery_dir

PhaseHook = Callable[[str], AbstractContextManager[Any]]
BACKGROUND_KEY = "surgery.route.background"
BACKGROUND = "route:background"  # its captures' name in messages; never a task name (no ':')

__all__ = [
    "CapturedTasks",
    "PhaseHook",
    "PreparedSurgery",
    "calibrate",
    "capture_tasks",
    "no_phase",
    "prepare_surgery",
]


def no_phase(name: str) -> AbstractContextManager[None]:
    """The default ``on_phase``: nothing around the phase."""
    return nullcontext()


@dataclass(frozen=True)
class PreparedSurgery:
    """A validated block with its targets located and its prompts read: ready to run."""

    block: Mapping[str, Any]
    config: SurgeryConfig
    tasks: list[ResolvedTask]
    targets: dict[str, str]  # task name -> local folder or Hub id
    prompts: dict[str, Prompts]
    background: Prompts | None = None  # route.background's prompts (no correction)
    overwrite: bool = False  # may replace a surgery/ that is there when the run writes its own
    # task name -> its checked dev documents (select metric lm_eval; hosts.lm_eval_dev)
    dev: Mapping[str, DevScorer] = field(default_factory=dict)
    joint: JointPlan | None = None  # the joint correction of every task, when the block fits one


def prepare_surgery(
    surgery_config: SurgeryConfig | Mapping[str, Any] | str | Path,
    *,
    reference: str,
    reference_label: str,
    out_path: str | Path,
    overwrite: bool = False,
    check_vocab: bool = True,
    chat_template_set: bool = False,
) -> PreparedSurgery:
    """Every check that needs no model weights, cheapest first; raises ``SurgeryConfigError``.

    ``reference`` is the model the targets must match: the base model before a merge, the merged
    folder after it. ``check_vocab=False`` skips the vocabulary checks when the merge builds its
    own tokenizer (they run again against the merged folder); ``chat_template_set`` when it sets
    the output's chat template (mergekit's ``chat_template:``).
    """
    block = _raw_block(surgery_config)
    config = parse_surgery(surgery_config if isinstance(surgery_config, SurgeryConfig) else block)
    tasks = resolve_tasks(config)
    check_output(out_path, overwrite)
    cache = check_cache_dir(config.cache_dir)
    if cache is not None and inside(cache, surgery_dir(out_path)):
        raise SurgeryConfigError(
            f"surgery.cache_dir: {cache} is inside {surgery_dir(out_path)}, which every "
            "calibration replaces whole (the captures would be deleted): choose a folder outside it"
        )
    for task in tasks:
        calibration_file(task)
    background = config.route.background if config.route is not None else None
    if background is not None:
        prompt_file(background, BACKGROUND_KEY)
    targets = check_targets(
        tasks,
        reference,
        reference_label,
        trust_remote_code=config.trust_remote_code,
        check_vocab=check_vocab,
        target_vocab=config.target_vocab,
        chat_template_set=chat_template_set,
        background=background,
    )
    shape = model_shape(reference, reference_label, trust_remote_code=config.trust_remote_code)
    tasks = [dataclasses.replace(task, model_type=shape.model_type) for task in tasks]
    for task in tasks:
        if same_path(targets[task.name], out_path):
            raise SurgeryConfigError(
                f"{task.key}.target: {task.target} is the merged folder {out_path} itself: the "
                "merge would replace the target's weights, and a model is no target of its own "
                "correction; write the merge elsewhere or name the fine-tune to recover"
            )
    prompts = {task.name: load_prompts(task) for task in tasks}
    for task in tasks:
        check_holdout(task, len(prompts[task.name].texts))
        check_folds(task, len(prompts[task.name].texts))
    background_prompts = None
    if config.route is not None:
        counts = {name: len(prompts[name].texts) for name in route_tasks(config)}
        if background is not None:
            background_prompts = read_prompts(background, BACKGROUND_KEY, "the router's background")
            counts[NONE_CLASS] = len(background_prompts.texts)
        check_route_holdout(config, counts)
    return PreparedSurgery(
        block,
        config,
        tasks,
        targets,
        prompts,
        background_prompts,
        overwrite,
        joint=plan_joint(config, tasks),
    )


def _raw_block(surgery_config: SurgeryConfig | Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    if isinstance(surgery_config, SurgeryConfig):
        return surgery_config.model_dump(mode="json", exclude_none=True)
    if isinstance(surgery_config, Mapping):
        return surgery_config
    return read_surgery_file(surgery_config)


def calibrate(
    merged_path: str | Path,
    prepared: PreparedSurgery,
    *,
    progress: bool = True,
    store: CaptureStore | None = None,
    on_phase: PhaseHook = no_phase,
) -> Manifest:
    """Capture, train and write ``merged_path/surgery/`` for a block ``prepare_surgery`` checked.

    Returns the manifest as written. The card, the recorded block and the summary are the
    post-merge step's (:mod:`mergekit_darts.hosts.post_merge`). ``on_phase(name)`` wraps
    each phase ("target", "merged", "train") in a context of the caller's (timers, memory peaks).
    """
    started = time.perf_counter()
    merged = Path(merged_path)
    identity = weights_identity(merged)  # before any capture: the weights the modules will fit
    store = store if store is not None else CaptureStore(prepared.config.cache_dir)
    stats = dataclasses.replace(store.stats)
    captured = capture_tasks(merged, prepared, progress=progress, store=store, on_phase=on_phase)
    for run in captured.runs:
        require_completion_tokens(run)
    fitted = joint = None
    dev = None
    if prepared.dev:  # loaded once, on first use, for every task's candidates
        dev = DevJudge(str(merged), captured.runtime, prepared.dev, store.stats)
    with on_phase("train"):
        try:
            for run in captured.runs:
                train_task(run, captured.runtime, dev)
        finally:
            if dev is not None:
                dev.close()
        if prepared.config.route is not None:
            with stage(None, "fitting the router"):
                fitted = _fit_router(prepared, captured)
        if prepared.joint is not None:
            with stage(None, "fitting the joint correction"):
                joint = fit_joint(prepared.joint, prepared.tasks, captured.runs)
    with stage(None, f"writing {surgery_dir(merged)}"):
        return write_surgery(
            merged,
            captured.runs,
            prepared.block,
            prepared.config,
            captured.runtime.device,
            load_merged_s=captured.load_merged_s,
            started=started,
            captures=store.stats.since(stats),
            router=fitted,
            joint=joint,
            identity=identity,
            replace=prepared.overwrite,
        )


def _fit_router(prepared: PreparedSurgery, captured: CapturedTasks) -> FittedRouter:
    """The gate of ``route:`` over the routed tasks' captures (and the background's)."""
    config, route = prepared.config, prepared.config.route
    runs = {run.task.name: run for run in captured.runs}
    tasks = [
        (name, runs[name].merged, runs[name].loss_mask(), runs[name].prompts.sha256)
        for name in route_tasks(config)
    ]
    background = None
    if captured.background is not None:
        background = (captured.background, prepared.background.sha256)
    fitted = fit_router(
        route_classes(tasks, background),
        background=background is not None,
        holdout=route.holdout,
        l2=route.l2,
        steps=route.steps,
        seed=config.seed,
        device=captured.runtime.device,
    )
    if background is not None:
        fitted.entry["background_calibration"] = calibration_record(
            route.background,
            prepared.background,
            [int(n) for n in captured.background.mask.sum(-1).tolist()],
        )
    return fitted


@dataclass
class CapturedTasks:
    """Every task's cached target and merged states, ready for training or diagnostics."""

    runs: list[TaskRun]
    runtime: Runtime
    load_merged_s: float
    background: Captured | None = None  # the merged model's states on route.background


def capture_tasks(
    merged_path: str | Path,
    prepared: PreparedSurgery,
    *,
    progress: bool = True,
    store: CaptureStore | None = None,
    on_phase: PhaseHook = no_phase,
) -> CapturedTasks:
    """Targets one at a time (completions first, if asked), then the merged model once.

    Captures come from ``store`` (default: a fresh one on the block's ``cache_dir``) when it has
    them; a model is loaded only for what it lacks. Calibration and ``mergekit-darts report
    --recompute`` both capture through here.
    """
    merged = Path(merged_path)
    config = prepared.config
    store = store if store is not None else CaptureStore(config.cache_dir)
    tokenizer = merged_tokenizer(merged, config.trust_remote_code)
    runtime = Runtime.of(config, tokenizer, progress)
    runs = [
        TaskRun(
            task,
            prepared.prompts[task.name],
            calibration_ids(task, prepared.prompts[task.name].texts, tokenizer),
        )
        for task in prepared.tasks
    ]
    calibrations = {
        run.task.name: Calibration.of(run.task, run.prompt_ids, prepared.targets[run.task.name])
        for run in runs
    }
    verdicts = {
        run.task.name: _verdict_calibration(run, prepared.targets[run.task.name])
        for run in runs
        if run.task.verdict
    }
    every = [*calibrations.values(), *verdicts.values()]
    eos = (
        saved_eos_token_ids(str(merged), tokenizer, config.trust_remote_code) if verdicts else set()
    )
    for target, group in group_by_target(every).items():
        with on_phase("target"):
            capture_target(store, target, group, runtime)  # loaded once, only if the store lacks it
    background = _background_calibration(prepared, tokenizer)
    with on_phase("merged"):
        merged_only = [background] if background is not None else []
        capture_merged(store, str(merged), [*every, *merged_only], runtime)
    load_merged_s = background.timings.pop("load_merged_s", 0.0) if background else 0.0
    for run in runs:
        cal = calibrations[run.task.name]
        load_merged_s += cal.timings.pop("load_merged_s", 0.0)
        run.sequences, run.completions, run.completion_mask = (
            cal.sequences,
            cal.completions,
            cal.completion_mask,
        )
        run.target, run.merged = cal.target, cal.merged
        run.timings.update(cal.timings)
        if run.task.name in verdicts:
            held = verdicts[run.task.name]
            run.held_completions = _held_out_completions(held, eos)
            load_merged_s += held.timings.pop("load_merged_s", 0.0)
            for name, seconds in held.timings.items():
                run.timings[name] = run.timings.get(name, 0.0) + seconds
    return CapturedTasks(runs, runtime, load_merged_s, background and background.merged)


def _verdict_calibration(run: TaskRun, target: str) -> Calibration:
    """The judged prompts, to be completed by the target for the verdict (calibrate.verdict).

    With folds, every prompt in order; else the held-out ones of the split training uses
    (``holdout_split`` of the task's count and seed).
    """
    task, metric = run.task, f"metric {run.task.select.metric}"
    judged = judged_rows(task, len(run.prompt_ids))
    return Calibration(
        name=task.name,  # messages name the task
        target_path=target,
        prompt_ids=[run.prompt_ids[i] for i in judged.tolist()],
        continuation_tokens=task.select.completion_tokens,
        batch_size=task.batch_size,
        with_head=True,
        head_need=None if task.select.metric == "completion_rho_l1" else f"select {metric}",
    )


def _held_out_completions(cal: Calibration, eos: set[int]) -> HeldOutCompletions:
    reference, predicting = completion_reference(
        cal.prompt_ids, cal.completions, cal.continuation_tokens
    )
    return HeldOutCompletions(cal.merged, cal.target, reference, predicting, frozenset(eos))


def _background_calibration(prepared: PreparedSurgery, tokenizer: Any) -> Calibration | None:
    """route.background as one more capture of the merged model (no target, no completion)."""
    if prepared.background is None:
        return None
    config = prepared.config
    cal = config.route.background
    ids = tokenize_prompts(
        tokenizer,
        prepared.background.texts,
        max_length=cal.max_length,
        chat_template=cal.chat_template,
        key=BACKGROUND_KEY,
    )
    return Calibration(
        name=BACKGROUND,
        target_path="",
        prompt_ids=ids,
        continuation_tokens=0,
        batch_size=config.batch_size,
        with_head=False,
        sequences=ids,
    )
