"""Memory of the LM head copies that kl / ce / select keep.

Tasks that compare next-token distributions keep each model's output path (:class:`OutputHead`,
a float32 copy of the LM head: 0.5 GB at 7B with V = 32000). Several tasks on one target with
their own prompts used to keep one copy per capture; the pipeline now shares one per model. This
runs the real ``run_surgery`` with ``HEAD_TASKS`` kl tasks on one bfloat16 target (a float32
model's head on its own device is no copy at all, so the cost shows only below float32) and
reports the peak RSS of each phase in units of one float32 head.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

HEAD_TASKS = 4  # kl tasks on one target, each with its own prompt set
HEAD_STEPS = 3  # memory does not depend on steps; kl at V = 32000 costs ~0.4 s a step per thread


def phase_heads(merged: str, block: dict[str, Any], device: str) -> dict[str, Any]:
    """Run ``run_surgery`` on ``block`` with each phase's peak memory tracked."""
    from benchmarks.measure import PeakTracker, quiet, warm_imports
    from mergekit_darts import run_surgery

    quiet()
    warm_imports()
    tracker = PeakTracker(cuda=device.startswith("cuda"))
    run_surgery(
        merged, block, overwrite=True, progress=False, write_card=False, on_phase=tracker.phase
    )
    return tracker.finish()


def head_block(target: str, calibration: str, settings: Any) -> dict[str, Any]:
    """``HEAD_TASKS`` kl tasks on ``target``; task i calibrates on the first n - i prompts."""
    tasks = [
        {
            "name": f"kl{i}",
            "target": target,
            "calibration": {
                "path": calibration,
                "field": "text",
                "num_samples": max(1, settings.n - i),
                "max_length": settings.max_length,
            },
        }
        for i in range(HEAD_TASKS)
    ]
    return {
        "module": "pos_corr",
        "loss": "kl",
        "rank": settings.rank,
        "max_positions": settings.max_positions,
        "steps": min(settings.steps, HEAD_STEPS),
        "batch_size": settings.batch_size,
        "device": settings.device,
        "tasks": tasks,
    }


def run(settings: Any, root: Path, calibration: str, tick: Any) -> dict[str, Any]:
    """Peak memory of ``HEAD_TASKS`` kl tasks on one target, per phase, in float32 heads."""
    from benchmarks.fixtures import build_pair, shadow_model
    from benchmarks.measure import run_isolated

    spec = dataclasses.replace(settings.model, dtype="bfloat16")
    tick(f"calibration: {HEAD_TASKS} kl tasks on one bfloat16 target (LM head copies)")
    pair = build_pair(root / "models", spec)
    merged = shadow_model(pair.merged, root / "heads-merged")
    block = head_block(pair.target, calibration, settings)
    memory = run_isolated(phase_heads, merged, block, settings.device, isolate=settings.isolate)
    head_bytes = spec.vocab * spec.hidden * 4
    growth = "peak_cuda_growth" if settings.device.startswith("cuda") else "peak_rss_growth"
    return {
        "tasks": HEAD_TASKS,
        "dtype": spec.dtype,
        "head_float32_bytes": head_bytes,
        "peak_growth_bytes": memory["peak_rss_growth"],
        "phases": {
            name: {"growth_bytes": phase[growth], "in_heads": phase[growth] / head_bytes}
            for name, phase in memory["phases"].items()
        },
        "peak_in_heads": memory["peak_rss_growth"] / head_bytes,
        "memory": memory,
    }
