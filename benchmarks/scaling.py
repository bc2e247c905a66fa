"""How calibration cost grows with N, prompt length T, rank and hidden size H.

One axis moves at a time around the calibration point. Each point times the precompute (merged
capture + target capture with entropy, the pipeline's calls) and a pos_corr training run of
``scale_steps`` steps; the per-step time is constant over a run, so the table extrapolates it to
the full ``steps`` to keep the sweep inside the time budget (the real 500-step runs are in the
calibration section). Model loading depends on H only and is timed once per H.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.fixtures import build_pair, calibration_texts

AXES = ("rank", "N", "T", "H")  # rank first: its points all share one precompute


def _point_key(n: int, t: int, hidden: int) -> tuple[int, int, int]:
    return n, t, hidden


class _Models:
    """Merged/target models and tokenizer per hidden size, loaded once and timed."""

    def __init__(self, settings: Any, root: Path):
        self.settings, self.root = settings, root
        self.loaded: dict[int, tuple[Any, Any, Any]] = {}
        self.load_seconds: dict[int, float] = {}

    def get(self, hidden: int) -> tuple[Any, Any, Any]:
        if hidden not in self.loaded:
            from transformers import AutoTokenizer

            from benchmarks.calibration import load
            from benchmarks.settings import with_model

            for key in list(self.loaded):  # one pair in memory at a time
                del self.loaded[key]
            gc.collect()
            pair = build_pair(self.root, with_model(self.settings, hidden=hidden).model)
            started = time.perf_counter()
            merged = load(pair.merged, self.settings.device)
            target = load(pair.target, self.settings.device)
            self.load_seconds[hidden] = (time.perf_counter() - started) / 2
            tokenizer = AutoTokenizer.from_pretrained(pair.merged)
            self.loaded[hidden] = (merged, target, tokenizer)
        return self.loaded[hidden]


def _precompute(models: _Models, n: int, t: int, hidden: int) -> tuple[Any, Any, float, int]:
    import torch

    from benchmarks.measure import clock, cuda_sync
    from mergekit_darts.calibrate.capture import capture
    from mergekit_darts.calibrate.data import tokenize_prompts

    now = clock()
    merged, target, tokenizer = models.get(hidden)
    settings = models.settings
    texts = calibration_texts(tokenizer, n, t)
    sequences = tokenize_prompts(tokenizer, texts, max_length=t, chat_template=False, key="scale")
    common = dict(
        batch_size=settings.batch_size,
        cache_dtype=torch.bfloat16,
        cache_device=settings.device,
        progress=False,
    )
    sync = cuda_sync(settings.device)
    started = now()
    merged_cap = capture(merged, sequences, **common)
    target_cap = capture(target, sequences, with_entropy=True, **common)
    if sync:
        sync()
    seconds = now() - started
    return merged_cap, target_cap, seconds, merged_cap.nbytes + target_cap.nbytes


def _train(merged_cap: Any, target_cap: Any, rank: int, settings: Any) -> tuple[float, int]:
    """Seconds per training step (the final evaluation timed separately and taken off)."""
    from benchmarks.measure import clock
    from mergekit_darts import build_module
    from mergekit_darts.calibrate.train import TrainSettings, measure_bias, train_surgery

    now = clock()
    hidden = merged_cap.hidden.shape[-1]
    positions = max(settings.max_positions, merged_cap.hidden.shape[1])
    module = build_module("pos_corr", hidden, rank, positions, seed=0)
    started = now()
    result = train_surgery(
        module,
        merged_cap,
        target_cap,
        TrainSettings(steps=settings.scale_steps, batch_size=settings.batch_size),
        device=settings.device,
        progress=False,
    )
    middle = now()
    measure_bias(result.module, merged_cap, target_cap, merged_cap.mask)
    loop = (middle - started) - (now() - middle)
    params = sum(p.numel() for p in module.parameters())
    return max(loop, 0.0) / max(1, settings.scale_steps), params


def sweep_points(settings: Any) -> list[tuple[str, int, dict[str, int]]]:
    """(axis, value, point) for every point; the calibration point appears on every axis."""
    base = {
        "N": settings.n,
        "T": settings.max_length,
        "rank": settings.rank,
        "H": settings.model.hidden,
    }
    values = {
        "N": settings.scale_n,
        "T": settings.scale_t,
        "rank": settings.scale_rank,
        "H": settings.scale_hidden,
    }
    return [(axis, v, base | {axis: v}) for axis in AXES for v in values[axis]]


def run(settings: Any, root: Path, tick: Callable[[str], None]) -> dict[str, Any]:
    """Rows of the scaling table; precompute results are shared between points that agree."""
    models = _Models(settings, root)
    pre: dict[tuple[int, int, int], tuple[float, int]] = {}
    trained: dict[tuple[int, int, int, int], tuple[float, int]] = {}
    held: dict[tuple[int, int, int], tuple[Any, Any]] = {}  # the latest captures only
    rows = []
    for axis, value, point in sweep_points(settings):
        tick(f"scaling: {axis}={value}")
        n, t, rank, hidden = point["N"], point["T"], point["rank"], point["H"]
        key = _point_key(n, t, hidden)
        if (*key, rank) not in trained:
            if key not in held:
                held.clear()
                merged_cap, target_cap, seconds, nbytes = _precompute(models, n, t, hidden)
                pre.setdefault(key, (seconds, nbytes))
                held[key] = (merged_cap, target_cap)
            trained[(*key, rank)] = _train(*held[key], rank, settings)
        precompute_s, cache_bytes = pre[key]
        step_s, params = trained[(*key, rank)]
        train_s = step_s * settings.steps
        rows.append(
            {
                "axis": axis,
                "value": value,
                "N": n,
                "T": t,
                "rank": rank,
                "H": hidden,
                "load_s": models.load_seconds[hidden],
                "precompute_s": precompute_s,
                "train_step_ms": step_s * 1e3,
                "train_s": train_s,
                "total_s": precompute_s + train_s,
                "cache_bytes": cache_bytes,
                "params": params,
            }
        )
    held.clear()
    models.loaded.clear()
    gc.collect()
    return {"rows": rows, "steps": settings.steps, "measured_steps": settings.scale_steps}
