"""What calibration writes: ``surgery/`` with the modules, the manifest, diagnostics and the block.

Everything lands in one staged folder (:func:`mergekit_darts.folder.artifacts.write_surgery_folder`), so
``surgery/`` appears whole or not at all. The manifest entry of a task records its settings (the
schema's names, :func:`~mergekit_darts.calibrate.choose.settings_of`), the prompts by hash, the
metrics and timings; its diagnostics file keeps the per-token bias before and after, so
``mergekit-darts report`` draws Figure 1 without loading a model. Recording the block in the
merge's recipe and the model card is the post-merge step's
(:mod:`mergekit_darts.hosts.mergekit.record`, :mod:`~mergekit_darts.present.card`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch
import yaml

from mergekit_darts.calibrate.choose import TaskRun, settings_of
from mergekit_darts.calibrate.continuation import tokens_sha256
from mergekit_darts.calibrate.data import Prompts
from mergekit_darts.calibrate.fit_router import FittedRouter
from mergekit_darts.calibrate.joint import FittedJoint
from mergekit_darts.config import CalibrationConfig, SurgeryConfig, model_shape
from mergekit_darts.correction.metrics import rho_from_deltas
from mergekit_darts.errors import SurgeryRunError
from mergekit_darts.folder.artifacts import read_manifest, write_surgery_folder
from mergekit_darts.folder.diagnostics import diagnostics_bytes
from mergekit_darts.folder.identity import weights_identity
from mergekit_darts.folder.manifest import (
    BLOCK_KEY,
    SURGERY_YAML,
    JointEntry,
    Manifest,
    RouterEntry,
    TaskEntry,
    diagnostics_file,
    surgery_dir,
)

LOSS_CURVE_POINTS = 200  # the manifest keeps at most this many points of each loss curve


def write_surgery(
    merged: Path,
    runs: list[TaskRun],
    block: Mapping[str, Any],
    config: SurgeryConfig,
    device: str,
    *,
    load_merged_s: float,
    started: float,
    captures: dict[str, int],
    router: FittedRouter | None = None,
    joint: FittedJoint | None = None,
    identity: str | None,
    replace: bool,
) -> Manifest:
    """Modules, manifest, diagnostics and the block, in one atomic folder; returns the manifest.

    ``started`` is the run's ``time.perf_counter()`` at its start (the manifest's ``total_s``);
    ``captures`` the store's counts for the run; ``router`` the gate of ``route:`` (written to
    ``router.safetensors``, its entry to the manifest's ``router``); ``joint`` the joint
    correction (``joint.safetensors``, the manifest's ``joint``).

    ``identity`` is the ``weights_identity`` of ``merged`` taken before anything was captured,
    and recorded as ``merged_identity``: weights that changed since (another merge or calibration
    into the same folder) are refused, nothing is written. So is a ``surgery/`` that appeared
    during the run, unless ``replace`` (the run's overwrite flag).
    """
    if weights_identity(merged) != identity:
        raise SurgeryRunError(
            f"the weights in {merged} changed while calibrating (another merge or calibration "
            f"into the same folder?), so the modules fit weights that are no longer there: "
            f"nothing was written; run one merge or calibration per folder at a time, then "
            f"`mergekit-darts calibrate {merged} SURGERY_YML`"
        )
    trust = config.trust_remote_code
    shape = model_shape(str(merged), f"merged model {merged}", trust_remote_code=trust)
    manifest = Manifest(
        hidden_size=runs[0].merged.hidden.shape[-1],
        vocab_size=shape.vocab_size,
        config=SURGERY_YAML,
        device=device,
        cache_dtype=config.cache_dtype,
        versions=_versions(),
        timings={
            "load_merged_s": round(load_merged_s, 3),
            "total_s": round(time.perf_counter() - started, 3),
        },
        captures=captures,  # model loads, and captures computed or taken from the store
        merged_identity=identity,  # loaders refuse other weights
        tasks={run.task.name: _task_entry(run) for run in runs},
        router=None if router is None else RouterEntry.model_validate(router.entry),
        joint=None if joint is None else JointEntry.model_validate(joint.entry),
    )
    dumped = yaml.safe_dump({BLOCK_KEY: dict(block)}, sort_keys=False)
    extra = {SURGERY_YAML: dumped.encode("utf-8")}
    extra |= {diagnostics_file(run.task.name): _diagnostics(run) for run in runs}
    modules = {run.task.name: run.result.module for run in runs}
    try:
        write_surgery_folder(
            surgery_dir(merged),
            modules,
            manifest,
            extra_files=extra,
            router=router.router if router is not None else None,
            joint=joint.module if joint is not None else None,
            replace=replace,
        )
    except FileExistsError:
        raise SurgeryRunError(
            f"{surgery_dir(merged)} appeared while calibrating (another run into {merged}?) and "
            "is left as it is: nothing was written; pass the overwrite flag to replace it"
        ) from None
    return read_manifest(surgery_dir(merged))


def calibration_record(
    cal: CalibrationConfig,
    prompts: Prompts,
    prompt_tokens: list[int],
    *,
    continuation_tokens: int | None = None,
) -> dict[str, Any]:
    """The manifest's record of calibration prompts (a task's, or the router's background):
    where they came from, how they were cut, and each prompt's sha256 and token count."""
    return {
        "source": prompts.source,
        **({"template": cal.template} if cal.template else {"field": cal.field or "text"}),
        "num_samples": cal.num_samples,
        "num_prompts": len(prompts.texts),
        # records whose prompt came earlier in the source: used once (a repeat could be held out)
        **({"duplicate_records": prompts.duplicates} if prompts.duplicates else {}),
        "max_length": cal.max_length,
        "chat_template": cal.chat_template,
        **({} if continuation_tokens is None else {"continuation_tokens": continuation_tokens}),
        "prompt_sha256": list(prompts.sha256),
        "prompt_tokens": prompt_tokens,
    }


def _task_entry(run: TaskRun) -> TaskEntry:
    task, result = run.task, run.result
    cal = task.calibration
    counted = run.trained(run.loss_mask())
    calibration = calibration_record(
        cal,
        run.prompts,
        [len(ids) for ids in run.prompt_ids],
        continuation_tokens=cal.continuation_tokens,
    )
    if run.completions is not None:
        calibration["completion_tokens"] = [len(c) for c in run.completions]
        calibration["completion_sha256"] = [tokens_sha256(c) for c in run.completions]
    return TaskEntry(
        **settings_of(task),
        target=task.target,
        eval_tasks=list(task.eval_tasks),
        calibration=calibration,
        metrics={
            "rho_l1": result.rho_l1,
            "delta_before": _mean(result.delta_before, counted),
            "delta_after": _mean(result.delta_after, counted),
            "final_loss": result.final_loss,
            "tokens": int(counted.sum()),
            **_position_metrics(run),
            **_curve(result.loss_curve),
        },
        timings={name: round(seconds, 3) for name, seconds in run.timings.items()},
        diagnostics=diagnostics_file(task.name),
        held_out=run.held_out,
        selection=run.selection,
    )


def _position_metrics(run: TaskRun) -> dict[str, float | None]:
    """rho_L1 over all real tokens and, with completions, over prompt and completion tokens."""
    before, after = run.delta_all
    real = run.trained(run.merged.mask.cpu())
    metrics = {"rho_l1_all": rho_from_deltas(before, after, real)}
    if run.completion_mask is not None:
        metrics["rho_l1_prompt"] = rho_from_deltas(before, after, real & ~run.completion_mask)
        metrics["rho_l1_completion"] = rho_from_deltas(before, after, real & run.completion_mask)
    return metrics


def _diagnostics(run: TaskRun) -> bytes:
    """Per-token bias before/after (the paper's Figure 1 heat map) without recomputing anything."""
    before, after = run.delta_all
    entropy = run.target.entropy
    return diagnostics_bytes(
        run.sequences,
        run.merged.mask.cpu(),
        run.loss_mask(),
        before,
        after,
        completion_mask=run.completion_mask,
        entropy=None if entropy is None else entropy.cpu(),
    )


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
