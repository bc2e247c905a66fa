"""``run_surgery``: calibrate one surgery module per task on a merged folder and save them there.

Resource contract (DESIGN.md): one full model in memory at a time and K + 1 model loads for K
tasks. Each target is loaded in turn (it may first extend its prompts with its own greedy
completion, which is why targets come first), its hidden states and entropies are cached, and it
is freed; then the merged model is loaded once and run over every task's token sequences; then
each module is trained on the cached states. Nothing is written until every task has succeeded,
and then ``surgery/`` appears in one rename, so a failure leaves the merged folder as it was.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import save as safetensors_bytes
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from .artifacts import read_manifest, write_surgery_folder
from .capture import Captured, capture
from .card import print_summary, update_model_card
from .config import (
    ResolvedTask,
    SurgeryConfig,
    SurgeryConfigError,
    SurgeryError,
    calibration_file,
    check_output,
    check_targets,
    model_shape,
    parse_surgery,
    read_surgery_file,
    resolve_device,
    resolve_tasks,
)
from .continuation import continue_prompts, eos_token_ids, tokens_sha256
from .data import Prompts, load_prompts, tokenize_prompts
from .metrics import rho_from_deltas
from .modules import build_module
from .record import record_block
from .train import TrainResult, TrainSettings, evaluate, train_surgery

SURGERY_YAML = "surgery.yml"
LOSS_CURVE_POINTS = 200  # the manifest keeps at most this many points of each loss curve


class SurgeryRunError(SurgeryError, RuntimeError):
    """Surgery failed after validation; the message names the task and the stage."""


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


def run_surgery(
    merged_path: str | Path,
    surgery_config: SurgeryConfig | Mapping[str, Any] | str | Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
    write_card: bool = True,
) -> dict[str, Any]:
    """Calibrate and save ``merged_path/surgery/``; returns the manifest as written.

    ``surgery_config`` is the block (a mapping or a ``SurgeryConfig``) or a YAML file holding a
    merge config with ``surgery:`` or just the block. An existing ``surgery/`` is replaced only
    with ``overwrite``. ``write_card`` appends the surgery section to ``README.md``.
    """
    merged = Path(merged_path)
    if not (merged / "config.json").is_file():
        raise SurgeryConfigError(
            f"{merged} is not a merged model folder (no config.json); run the merge first"
        )
    prepared = prepare_surgery(
        surgery_config,
        reference=str(merged.resolve()),
        reference_label=f"merged model {merged}",
        out_path=merged,
        overwrite=overwrite,
    )
    return run_prepared(merged, prepared, progress=progress, write_card=write_card)


def run_prepared(
    merged_path: str | Path,
    prepared: PreparedSurgery,
    *,
    progress: bool = True,
    write_card: bool = True,
) -> dict[str, Any]:
    """The expensive part of :func:`run_surgery`, for a block ``prepare_surgery`` has checked."""
    started = time.perf_counter()
    merged = Path(merged_path)
    captured = capture_tasks(merged, prepared, progress=progress)
    for run in captured.runs:
        _train_phase(run, captured.env)
    with _stage(None, f"writing {merged / 'surgery'}"):
        written = _write(
            captured.runs, merged, prepared, captured.env, captured.load_merged_s, started
        )
    record_block(merged, prepared.block, card=write_card)
    if write_card:
        update_model_card(merged, written)
    if progress:
        print_summary(written)
    return written


@dataclass
class CapturedTasks:
    """Every task's cached target and merged states, ready for training or diagnostics."""

    runs: list[_TaskRun]
    env: _Env
    load_merged_s: float


def capture_tasks(
    merged_path: str | Path, prepared: PreparedSurgery, *, progress: bool = True
) -> CapturedTasks:
    """Targets one at a time (completions first, if asked), then the merged model once."""
    merged = Path(merged_path)
    config = prepared.config
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            merged, trust_remote_code=config.trust_remote_code
        )
    except Exception as err:  # no tokenizer files, or unreadable ones
        raise SurgeryConfigError(
            f"{merged} has no usable tokenizer ({type(err).__name__}); calibration tokenizes "
            "with the merged model's tokenizer: copy one into the folder"
        ) from err
    env = _Env(
        config,
        resolve_device(config.device),
        tokenizer,
        _pad_id(tokenizer),
        getattr(torch, config.cache_dtype),
        progress,
    )
    runs = [
        _TaskRun(task, prepared.prompts[task.name], _tokenize(task, prepared, tokenizer))
        for task in prepared.tasks
    ]
    for run in runs:
        _target_phase(run, prepared.targets[run.task.name], env)
    load_merged_s = _merged_phase(runs, merged, env)
    return CapturedTasks(runs, env, load_merged_s)


def _tokenize(task: ResolvedTask, prepared: PreparedSurgery, tokenizer: Any) -> list[list[int]]:
    """Prompt token ids, leaving room for the completion inside ``max_length``."""
    cal = task.calibration
    return tokenize_prompts(
        tokenizer,
        prepared.prompts[task.name].texts,
        max_length=cal.max_length - cal.continuation_tokens,
        chat_template=cal.chat_template,
        key=f"{task.key}.calibration",
    )


# ---- the three phases ----------------------------------------------------------------------------


def _target_phase(run: _TaskRun, target: str, env: _Env) -> None:
    task, name = run.task, run.task.name
    with _stage(name, f"loading target {task.target}"), _timer(run.timings, "load_target_s"):
        model = _load_model(target, env)
    run.sequences = run.prompt_ids
    if task.calibration.continuation_tokens:
        with _stage(name, "generating the target's completions"), _timer(run.timings, "generate_s"):
            continued = continue_prompts(
                model,
                run.prompt_ids,
                max_new_tokens=task.calibration.continuation_tokens,
                eos_ids=eos_token_ids(model, env.tokenizer),
                pad_id=env.pad_id,
                batch_size=task.batch_size,
                progress=env.progress,
                desc=f"{name}: generate",
            )
        run.sequences, run.completions = continued.sequences, continued.completions
        run.completion_mask = continued.mask
        if task.loss_positions == "completion" and not continued.mask.any():
            raise SurgeryRunError(
                f"surgery task {name!r}: the target ended every completion at once (EOS first), "
                "so loss_positions: completion has no token to train on; use loss_positions: all"
            )
    with (
        _stage(name, "capturing the target's hidden states"),
        _timer(run.timings, "capture_target_s"),
    ):
        # entropy always: the target computes its logits anyway, and the report plots it
        run.target = _capture(model, run, env, with_entropy=True, desc="target")
    del model
    _release(env.device)


def _merged_phase(runs: list[_TaskRun], merged: Path, env: _Env) -> float:
    """Load the merged model once and capture every task's sequences; returns the load time."""
    timings: dict[str, float] = {}
    with _stage(None, f"loading the merged model {merged}"), _timer(timings, "load"):
        model = _load_model(str(merged), env)
    for run in runs:
        with (
            _stage(run.task.name, "capturing the merged model's hidden states"),
            _timer(run.timings, "capture_merged_s"),
        ):
            run.merged = _capture(model, run, env, with_entropy=False, desc="merged")
    del model
    _release(env.device)
    return timings["load"]


def _capture(
    model: nn.Module, run: _TaskRun, env: _Env, *, with_entropy: bool, desc: str
) -> Captured:
    return capture(
        model,
        run.sequences,
        batch_size=run.task.batch_size,
        with_entropy=with_entropy,
        with_head=run.task.loss in ("kl", "ce"),
        cache_dtype=env.cache_dtype,
        cache_device=env.device,
        pad_id=env.pad_id,
        desc=f"{run.task.name}: {desc}",
        progress=env.progress,
    )


def _train_phase(run: _TaskRun, env: _Env) -> None:
    task = run.task
    with _stage(task.name, "training"), _timer(run.timings, "train_s"):
        module = build_module(
            task.module, run.merged.hidden.shape[-1], task.rank, task.max_positions, seed=task.seed
        )
        settings = TrainSettings(task.loss, task.steps, task.lr, task.batch_size, task.seed)
        run.result = train_surgery(
            module,
            run.merged,
            run.target,
            settings,
            loss_mask=None if task.loss_positions == "all" else _loss_mask(run).to(env.device),
            device=env.device,
            progress=env.progress,
            desc=f"{task.name}: train",
        )
        before, after, _ = evaluate(run.result.module, run.merged, run.target, run.merged.mask)
        run.delta_all = (before, after)


def _loss_mask(run: _TaskRun) -> torch.Tensor:
    """[N, T] bool on the CPU: the real tokens the loss and rho_L1 cover."""
    real = run.merged.mask.cpu()
    return real if run.task.loss_positions == "all" else real & run.completion_mask


# ---- what is written -----------------------------------------------------------------------------


def _write(
    runs: list[_TaskRun],
    merged: Path,
    prepared: PreparedSurgery,
    env: _Env,
    load_merged_s: float,
    started: float,
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
        "tasks": {run.task.name: _task_entry(run) for run in runs},
    }
    block = yaml.safe_dump({"surgery": dict(prepared.block)}, sort_keys=False)
    extra = {SURGERY_YAML: block.encode("utf-8")}
    extra |= {_diagnostics_file(run.task.name): _diagnostics(run) for run in runs}
    modules = {run.task.name: run.result.module for run in runs}
    write_surgery_folder(merged / "surgery", modules, manifest, extra_files=extra)
    return read_manifest(merged / "surgery")


def _task_entry(run: _TaskRun) -> dict[str, Any]:
    task, result = run.task, run.result
    cal = task.calibration
    counted = _loss_mask(run)
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
        "diagnostics": _diagnostics_file(task.name),
    }
    if run.completions is not None:
        entry["calibration"]["completion_tokens"] = [len(c) for c in run.completions]
        entry["calibration"]["completion_sha256"] = [tokens_sha256(c) for c in run.completions]
    return entry


def _position_metrics(run: _TaskRun) -> dict[str, float | None]:
    """rho_L1 over all real tokens and, with completions, over prompt and completion tokens."""
    before, after = run.delta_all
    real = run.merged.mask.cpu()
    metrics = {"rho_l1_all": rho_from_deltas(before, after, real)}
    if run.completion_mask is not None:
        metrics["rho_l1_prompt"] = rho_from_deltas(before, after, real & ~run.completion_mask)
        metrics["rho_l1_completion"] = rho_from_deltas(before, after, run.completion_mask)
    return metrics


def _diagnostics_file(task: str) -> str:
    return f"diagnostics/{task}.safetensors"


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


def _load_model(path: str, env: _Env) -> nn.Module:
    """One full model in the dtype its config records (the merge's ``dtype`` for the merge)."""
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype="auto",
        device_map=env.config.device_map or env.device,
        trust_remote_code=env.config.trust_remote_code,
    )
    return model.eval()


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _pad_id(tokenizer: Any) -> int:
    """A filler id for padded slots (masked out everywhere, so any real id will do)."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, int):
            return candidate
    return 0


@contextmanager
def _stage(task: str | None, stage: str) -> Iterator[None]:
    """Turn any failure into one line naming the task and what it was doing."""
    try:
        yield
    except SurgeryError:
        raise
    except Exception as err:
        who = f"surgery task {task!r}" if task else "surgery"
        detail = " ".join(f"{type(err).__name__}: {err}".split())[:400]
        raise SurgeryRunError(
            f"{who} failed while {stage}: {detail}; the merged model and any existing surgery/ "
            "folder are unchanged"
        ) from err


@contextmanager
def _timer(timings: dict[str, float], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start
