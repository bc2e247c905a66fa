"""Run the chosen sections in order and gather one results dictionary."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks import calibration, inference, scaling, startup, store
from benchmarks.fixtures import Pair, build_pair
from benchmarks.measure import apply_threads, choose_clock, choose_threads, loadavg, machine_info
from benchmarks.settings import BenchSettings


def count_steps(settings: BenchSettings) -> int:
    """Progress ticks the run will make (one per measured unit of work)."""
    steps = 0
    if "calibration" in settings.sections:
        steps += 1 + len(settings.kinds) + 4
    if "store" in settings.sections:
        steps += 3
    if "inference" in settings.sections:
        steps += len(_inference_sizes(settings))
    if "startup" in settings.sections:
        steps += len(settings.startup)
    if "scaling" in settings.sections:
        steps += len(scaling.sweep_points(settings))
    return steps


def _inference_sizes(settings: BenchSettings) -> tuple[int, ...]:
    return settings.inference_hidden


@contextmanager
def _workdir(settings: BenchSettings) -> Iterator[Path]:
    if settings.workdir:
        path = Path(settings.workdir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="darts-bench-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_all(settings: BenchSettings, tick: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every section in ``settings.sections``; ratios of all sections end up in ``ratios``.

    Thread count and clock are process-wide settings; they are put back afterwards, so a test
    session that calls this goes on as before.
    """
    import torch

    saved_threads = torch.get_num_threads()
    saved_env = {k: os.environ.get(k) for k in _ENV}
    try:
        return _run_all(settings, tick or (lambda _label: None))
    finally:
        torch.set_num_threads(saved_threads)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


_ENV = (
    "TQDM_DISABLE",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "DARTS_BENCH_CLOCK",
)


def _run_all(settings: BenchSettings, tick: Callable[[str], None]) -> dict[str, Any]:
    os.environ.setdefault("TQDM_DISABLE", "1")  # library progress bars; ours is the only one
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    started = time.perf_counter()
    threads, why = choose_threads(settings.threads, settings.device)
    machine = machine_info(settings.device)
    machine["torch_threads"] = apply_threads(threads)
    machine["threads_reason"] = why
    machine["clock"] = choose_clock(settings.device, machine["torch_threads"])
    results: dict[str, Any] = {"machine": machine, "settings": settings.to_dict(), "ratios": {}}
    with _workdir(settings) as root:
        pair = None
        if {"calibration", "store"} & set(settings.sections):
            tick("calibration: building the model pair")
            pair = (
                Pair(settings.merged, settings.target)
                if settings.merged and settings.target
                else build_pair(root, settings.model)
            )
        if "calibration" in settings.sections:
            results["calibration"] = calibration.run(settings, pair, root / "calibration", tick)
        if "store" in settings.sections:
            results["store"] = store.run(settings, pair, root / "store", tick)
        if "inference" in settings.sections:
            results["inference"] = inference.run(settings, root, tick)
        if "startup" in settings.sections:
            results["startup"] = startup.run(settings, tick)
        if "scaling" in settings.sections:
            results["scaling"] = scaling.run(settings, root, tick)
    for section in ("calibration", "store", "inference", "startup"):
        results["ratios"].update(results.get(section, {}).get("ratios", {}))
    results["machine"]["loadavg_end"] = loadavg()
    results["runtime_s"] = time.perf_counter() - started
    return results
