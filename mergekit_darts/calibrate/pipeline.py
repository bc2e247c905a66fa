"""The calibration pipeline: one surgery module per task, trained and saved in ``surgery/``.

Resource contract (DESIGN.md): one full model in memory at a time, and one load per distinct
model: K tasks naming T distinct targets cost T + 1 loads, and none whose captures the
:mod:`~mergekit_darts.calibrate.store` already holds. Each target is loaded in turn (it may first extend its
prompts with its own greedy completion, which is why targets come first), its hidden states and
entropies are captured once per distinct token sequence set, and it is freed; then the merged
model is loaded once and run over every task's sequences; then each module is trained on the
cached states. Nothing is written until every task has succeeded, and then ``surgery/`` appears
in one rename, so a failure leaves the merged folder as it was.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save as safetensors_bytes

from mergekit_darts.artifacts import read_manifest, write_surgery_folder
from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.calibrate.continuation import tokens_sha256
from mergekit_darts.calibrate.data import Prompts, calibration_ids, load_prompts
from mergekit_darts.calibrate.selection import HeldOut, choose, held_out_metrics, holdout_split
from mergekit_darts.calibrate.store import (
    Calibration,
    CaptureStore,
    Runtime,
    capture_merged,
    capture_target,
    check_cache_dir,
    group_by_target,
    merged_tokenizer,
    stage,
)
from mergekit_darts.calibrate.train import (
    TrainResult,
    TrainSettings,
    evaluate,
    in_rows,
    train_surgery,
)
from mergekit_darts.config import (
    ResolvedTask,
    SurgeryConfig,
    calibration_file,
    check_holdout,
    check_output,
    check_targets,
    model_shape,
    parse_surgery,
    read_surgery_file,
    resolve_tasks,
)
from mergekit_darts.core.losses import LOGIT_LOSSES
from mergekit_darts.core.metrics import rho_from_deltas
from mergekit_darts.core.modules import SurgeryModule, build_module
from mergekit_darts.errors import HeadError, SurgeryRunError
from mergekit_darts.manifest import BLOCK_KEY, SURGERY_YAML, diagnostics_file, surgery_dir

PhaseHook = Callable[[str], AbstractContextManager[Any]]
LOSS_CURVE_POINTS = 200  # the manifest keeps at most this many points of each loss curve

__all__ = ["PreparedSurgery", "calibrate", "capture_tasks", "prepare_surgery"]


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


def prepare_surgery(
    surgery_config: SurgeryConfig | Mapping[str, Any] | str | Path,
    *,
    reference: str,
    reference_label: str,
    out_path: str | Path,
    overwrite: bool = False,
    check_vocab: bool = True,
) -> PreparedSurgery:
    """Every check that needs no model weights, cheapest first; raises ``SurgeryConfigError``.

    ``reference`` is the model the targets must match: the base model before a merge, the merged
    folder after it. ``check_vocab=False`` skips the vocabulary checks when the merge builds its
    own tokenizer (they run again against the merged folder).
    """
    block = _raw_block(surgery_config)
    config = parse_surgery(surgery_config if isinstance(surgery_config, SurgeryConfig) else block)
    tasks = resolve_tasks(config)
    check_output(out_path, overwrite)
    check_cache_dir(config.cache_dir)
    for task in tasks:
        calibration_file(task)
    targets = check_targets(
        tasks,
        reference,
        reference_label,
        trust_remote_code=config.trust_remote_code,
        check_vocab=check_vocab,
        target_vocab=config.target_vocab,
    )
    prompts = {task.name: load_prompts(task) for task in tasks}
    for task in tasks:
        check_holdout(task, len(prompts[task.name].texts))
    return PreparedSurgery(block, config, tasks, targets, prompts)


def _raw_block(surgery_config: SurgeryConfig | Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    if isinstance(surgery_config, SurgeryConfig):
        return surgery_config.model_dump(mode="json", exclude_none=True)
    if isinstance(surgery_config, Mapping):
        return surgery_config
    return read_surgery_file(surgery_config)


@dataclass(frozen=True)
class _Env:
    """What every phase needs besides the task."""

    config: SurgeryConfig
    device: str
    tokenizer: Any  # the merged model's
    pad_id: int
    cache_dtype: torch.dtype
    progress: bool


@dataclass
class _TaskRun:
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


def calibrate(
    merged_path: str | Path,
    prepared: PreparedSurgery,
    *,
    progress: bool = True,
    store: CaptureStore | None = None,
    on_phase: PhaseHook = no_phase,
) -> dict[str, Any]:
    """Capture, train and write ``merged_path/surgery/`` for a block ``prepare_surgery`` checked.

    Returns the manifest as written. The card, the recorded block and the summary are the
    post-merge step's (:mod:`mergekit_darts.integrations.post_merge`). ``on_phase(name)`` wraps
    each phase ("target", "merged", "train") in a context of the caller's (timers, memory peaks).
    """
    started = time.perf_counter()
    merged = Path(merged_path)
    store = store if store is not None else CaptureStore(prepared.config.cache_dir)
    stats = dataclasses.replace(store.stats)
    captured = capture_tasks(merged, prepared, progress=progress, store=store, on_phase=on_phase)
    with on_phase("train"):
        for run in captured.runs:
            _train_phase(run, captured.env)
    with _stage(None, f"writing {surgery_dir(merged)}"):
        return _write(
            captured.runs,
            merged,
            prepared,
            captured.env,
            captured.load_merged_s,
            started,
            store.stats.since(stats),
        )


@dataclass
class CapturedTasks:
    """Every task's cached target and merged states, ready for training or diagnostics."""

    runs: list[_TaskRun]
    env: _Env
    load_merged_s: float


def capture_tasks(
    merged_path: str | Path,
    prepared: PreparedSurgery,
    *,
    progress: bool = True,
    store: CaptureStore | None = None,
    on_phase: PhaseHook = no_phase,
) -> CapturedTasks:
    """Targets one at a time (completions first, if asked), then the merged model once.

    Captures come from ``store`` when it has them; a model is loaded only for what it lacks.
    """
    merged = Path(merged_path)
    config = prepared.config
    store = store if store is not None else CaptureStore(config.cache_dir)
    tokenizer = merged_tokenizer(merged, config.trust_remote_code)
    runtime = Runtime.of(config, tokenizer, progress)
    env = _Env(config, runtime.device, tokenizer, runtime.pad_id, runtime.cache_dtype, progress)
    runs = [
        _TaskRun(
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
    for target, group in group_by_target(list(calibrations.values())).items():
        with on_phase("target"):
            capture_target(store, target, group, runtime)  # loaded once, only if the store lacks it
    with on_phase("merged"):
        capture_merged(store, str(merged), list(calibrations.values()), runtime)
    load_merged_s = 0.0
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
        _check_completions(run)
    return CapturedTasks(runs, env, load_merged_s)


def _check_completions(run: _TaskRun) -> None:
    if run.task.loss_positions == "completion" and not run.completion_mask.any():
        raise SurgeryRunError(
            f"surgery task {run.task.name!r}: the target ended every completion at once (EOS "
            "first), so loss_positions: completion has no token to train on; use "
            "loss_positions: all"
        )


# ---- training ----------------------------------------------------------------------------


def _train_phase(run: _TaskRun, env: _Env) -> None:
    """Train the task's module; with ``holdout`` measure it on held-out prompts, with ``select``
    train every candidate on the rest and keep the best (refit on every prompt unless refit off)."""
    task = run.task
    if task.needs_logits:
        _require_heads(run)
    with _stage(task.name, "training"), _timer(run.timings, "train_s"):
        if task.holdout:
            run.train_rows, run.held_rows = holdout_split(
                len(run.sequences), task.holdout, task.seed
            )
        if task.select is not None:
            chosen, module = _select(run, env)
            run.task = chosen
            if task.select.refit:
                run.train_rows = None
                run.result = _fit(run, chosen, env, None)
        else:
            run.result = _fit(run, task, env, run.train_rows)
            module = run.result.module
        if run.held_rows is not None:
            run.held_out = _held_out_entry(run, module, saved=run.train_rows is not None)
        before, after, _ = evaluate(run.result.module, run.merged, run.target, run.merged.mask)
        run.delta_all = (before, after)


def _fit(run: _TaskRun, task: ResolvedTask, env: _Env, rows: torch.Tensor | None) -> TrainResult:
    """One module with ``task``'s settings, on the sequences ``rows`` (None: all)."""
    module = build_module(
        task.module, run.merged.hidden.shape[-1], task.rank, task.max_positions, seed=task.seed
    )
    settings = TrainSettings(task.loss, task.steps, task.lr, task.batch_size, task.seed)
    return train_surgery(
        module,
        run.merged,
        run.target,
        settings,
        loss_mask=None if task.loss_positions == "all" else _loss_mask(run, task).to(env.device),
        rows=rows,
        device=env.device,
        progress=env.progress,
        desc=f"{run.task.name}: train {task.module} + {task.loss}",
    )


def _select(run: _TaskRun, env: _Env) -> tuple[ResolvedTask, SurgeryModule]:
    """Every candidate on the training rows, scored on the held-out rows; returns the best.

    The score covers the task's loss positions; with completions each candidate is also
    measured on the completion tokens alone (recorded, not used for the choice).
    """
    task, select = run.task, run.task.select
    counted = in_rows(_loss_mask(run, task), run.held_rows)
    completion = None
    if run.completion_mask is not None:
        completion = in_rows(
            run.merged.mask & run.completion_mask.to(counted.device), run.held_rows
        )
    candidates, results, entries = task.candidates(), [], []
    for candidate in candidates:
        result = _fit(run, candidate, env, run.train_rows)
        held = held_out_metrics(result.module, run.merged, run.target, counted).summary()
        if completion is not None and completion.any():
            held["completion"] = held_out_metrics(
                result.module, run.merged, run.target, completion
            ).summary()
        results.append(result)
        entries.append({**_settings(candidate), "held_out": held, "final_loss": result.final_loss})
    chosen = choose([e["held_out"][select.metric] for e in entries], select.metric)
    run.result = results[chosen]
    run.selection = {
        "metric": select.metric,
        "holdout": task.holdout,
        "holdout_sha256": _held_sha256(run),
        "refit": select.refit,
        "candidates": entries,
        "chosen": chosen,
    }
    return candidates[chosen], results[chosen].module


def _settings(task: ResolvedTask) -> dict[str, Any]:
    keys = ("module", "loss", "rank", "max_positions", "steps", "lr", "batch_size", "seed")
    return {key: getattr(task, key) for key in (*keys, "loss_positions")}


def _held_out_entry(run: _TaskRun, module: SurgeryModule, *, saved: bool) -> dict[str, Any]:
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
        "prompt_sha256": _held_sha256(run),
        "saved_module": saved,  # false: the numbers are the chosen candidate's, before its refit
        **{name: held.as_dict() for name, held in measured.items()},
    }


def _held_sha256(run: _TaskRun) -> list[str]:
    return [run.prompts.sha256[i] for i in run.held_rows.tolist()]


def _require_heads(run: _TaskRun) -> None:
    """kl / ce / select by agreement or KL need logits the model really produces: one line if not."""
    task = run.task
    losses = sorted({c.loss for c in task.candidates()} & set(LOGIT_LOSSES))
    what = f"loss {losses[0]}" if losses else f"select metric {task.select.metric}"
    try:
        for captured in (run.target, run.merged):
            captured.head.require(what)
    except HeadError as err:
        raise SurgeryRunError(f"surgery task {task.name!r}: {err}") from None


def _loss_mask(run: _TaskRun, task: ResolvedTask | None = None) -> torch.Tensor:
    """[N, T] bool on the CPU: the real tokens the loss and rho_L1 cover."""
    real = run.merged.mask.cpu()
    positions = (task or run.task).loss_positions
    return real if positions == "all" else real & run.completion_mask


# ---- what is written -----------------------------------------------------------------------------


def _write(
    runs: list[_TaskRun],
    merged: Path,
    prepared: PreparedSurgery,
    env: _Env,
    load_merged_s: float,
    started: float,
    captures: dict[str, int],
) -> dict[str, Any]:
    """Modules, manifest, diagnostics and the block, in one atomic folder; returns the manifest."""
    trust = env.config.trust_remote_code
    shape = model_shape(str(merged), f"merged model {merged}", trust_remote_code=trust)
    manifest: dict[str, Any] = {
        "hidden_size": runs[0].merged.hidden.shape[-1],
        "vocab_size": shape.vocab_size,
        "config": SURGERY_YAML,
        "device": env.device,
        "cache_dtype": env.config.cache_dtype,
        "versions": _versions(),
        "timings": {
            "load_merged_s": round(load_merged_s, 3),
            "total_s": round(time.perf_counter() - started, 3),
        },
        "captures": captures,  # model loads, and captures computed or taken from the store
        "tasks": {run.task.name: _task_entry(run) for run in runs},
    }
    block = yaml.safe_dump({BLOCK_KEY: dict(prepared.block)}, sort_keys=False)
    extra = {SURGERY_YAML: block.encode("utf-8")}
    extra |= {diagnostics_file(run.task.name): _diagnostics(run) for run in runs}
    modules = {run.task.name: run.result.module for run in runs}
    write_surgery_folder(surgery_dir(merged), modules, manifest, extra_files=extra)
    return read_manifest(surgery_dir(merged))


def _task_entry(run: _TaskRun) -> dict[str, Any]:
    task, result = run.task, run.result
    cal = task.calibration
    counted = _trained(run, _loss_mask(run))
    entry: dict[str, Any] = {
        "module": task.module,
        "rank": task.rank,
        "max_positions": task.max_positions,
        "loss": task.loss,
        "steps": task.steps,
        "lr": task.lr,
        "batch_size": task.batch_size,
        "seed": task.seed,
        "target": task.target,
        "eval_tasks": list(task.eval_tasks),
        "loss_positions": task.loss_positions,
        "calibration": {
            "source": run.prompts.source,
            **({"template": cal.template} if cal.template else {"field": cal.field or "text"}),
            "num_samples": cal.num_samples,
            "num_prompts": len(run.prompts.texts),
            "max_length": cal.max_length,
            "chat_template": cal.chat_template,
            "continuation_tokens": cal.continuation_tokens,
            "prompt_sha256": list(run.prompts.sha256),
            "prompt_tokens": [len(ids) for ids in run.prompt_ids],
        },
        "metrics": {
            "rho_l1": result.rho_l1,
            "delta_before": _mean(result.delta_before, counted),
            "delta_after": _mean(result.delta_after, counted),
            "final_loss": result.final_loss,
            "tokens": int(counted.sum()),
            **_position_metrics(run),
            **_curve(result.loss_curve),
        },
        "timings": {name: round(seconds, 3) for name, seconds in run.timings.items()},
        "diagnostics": diagnostics_file(task.name),
    }
    if run.completions is not None:
        entry["calibration"]["completion_tokens"] = [len(c) for c in run.completions]
        entry["calibration"]["completion_sha256"] = [tokens_sha256(c) for c in run.completions]
    if run.held_out is not None:
        entry["held_out"] = run.held_out
    if run.selection is not None:
        entry["selection"] = run.selection
    return entry


def _trained(run: _TaskRun, mask: torch.Tensor) -> torch.Tensor:
    """``mask`` [N, T] limited to the sequences the saved module trained on."""
    return mask if run.train_rows is None else in_rows(mask, run.train_rows)


def _position_metrics(run: _TaskRun) -> dict[str, float | None]:
    """rho_L1 over all real tokens and, with completions, over prompt and completion tokens."""
    before, after = run.delta_all
    real = _trained(run, run.merged.mask.cpu())
    metrics = {"rho_l1_all": rho_from_deltas(before, after, real)}
    if run.completion_mask is not None:
        metrics["rho_l1_prompt"] = rho_from_deltas(before, after, real & ~run.completion_mask)
        metrics["rho_l1_completion"] = rho_from_deltas(before, after, real & run.completion_mask)
    return metrics


def _diagnostics(run: _TaskRun) -> bytes:
    """Per-token bias before/after (the paper's Figure 1 heat map) without recomputing anything."""
    before, after = run.delta_all
    real = run.merged.mask.cpu()
    ids = torch.zeros(real.shape, dtype=torch.int64)
    for row, seq in enumerate(run.sequences):
        ids[row, : len(seq)] = torch.as_tensor(seq)
    tensors = {
        "input_ids": ids,
        "mask": real.clone(),
        "loss_mask": _loss_mask(run).clone(),
        "delta_before": before.contiguous(),
        "delta_after": after.contiguous(),
    }
    if run.completion_mask is not None:
        tensors["completion_mask"] = run.completion_mask.contiguous()
    if run.target.entropy is not None:
        tensors["entropy"] = run.target.entropy.cpu().contiguous()
    # One metadata key: safetensors orders several at random, and the bytes must be reproducible.
    return safetensors_bytes(tensors, metadata={"format": "darts-surgery-diagnostics"})


def _mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float(values[mask].mean()) if mask.any() else 0.0


def _curve(curve: list[float]) -> dict[str, Any]:
    every = max(1, -(-len(curve) // LOSS_CURVE_POINTS))
    return {"loss_curve": curve[::every], "loss_curve_every": every}


def _versions() -> dict[str, str]:
    found = {}
    for package in ("mergekit-darts", "mergekit", "torch", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "unknown"
    return found


# ---- small helpers -------------------------------------------------------------------------------


_stage = stage


@contextmanager
def _timer(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start
