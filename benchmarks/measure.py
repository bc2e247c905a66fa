"""Measuring tools: peak memory per phase, isolated subprocesses, interleaved timings.

Peak RSS uses the kernel's own high-water mark (``VmHWM``), reset between phases by writing
``5`` to ``/proc/self/clear_refs``: exact, and free while the phase runs. Where that file is not
writable (other kernels, macOS) a 1 ms sampling thread stands in. Timing comparisons alternate
the two contenders and keep the fastest of each, because on a shared machine noise only ever
adds time.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

MiB = 1024**2
GiB = 1024**3


def _status_kib(key: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def current_rss() -> int:
    """Resident set size of this process in bytes."""
    rss = _status_kib("VmRSS")
    if rss is not None:
        return rss
    import psutil

    return psutil.Process().memory_info().rss


def _can_reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return _status_kib("VmHWM") is not None
    except OSError:
        return False


class _Sampler:
    """Fallback peak-RSS tracker: a daemon thread polling RSS every millisecond."""

    def __init__(self) -> None:
        self.peak = current_rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, current_rss())

    def reset(self) -> None:
        self.peak = current_rss()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class PeakTracker:
    """Peak RSS (and peak CUDA memory) of named phases of one process.

    ``overall`` keeps the maximum over everything since creation, phases or not, so phases can
    be measured one by one without losing the process-wide peak.
    """

    cuda: bool = False
    baseline_rss: int = 0
    phases: dict[str, dict[str, float]] = field(default_factory=dict)
    overall_rss: int = 0
    overall_cuda: int = 0

    def __post_init__(self) -> None:
        self._exact = _can_reset_hwm()
        self._sampler = None if self._exact else _Sampler()
        self.baseline_rss = current_rss()
        self.overall_rss = self.baseline_rss
        self._reset()

    def _peak_rss(self) -> int:
        if self._exact:
            return _status_kib("VmHWM") or current_rss()
        return self._sampler.peak

    def _peak_cuda(self) -> int:
        if not self.cuda:
            return 0
        import torch

        return int(torch.cuda.max_memory_allocated())

    def _fold(self) -> None:
        self.overall_rss = max(self.overall_rss, self._peak_rss())
        self.overall_cuda = max(self.overall_cuda, self._peak_cuda())

    def _reset(self) -> None:
        if self._exact:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
        else:
            self._sampler.reset()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    @contextmanager
    def phase(self, name: str) -> Iterator[dict[str, float]]:
        """Time a phase and record its peak RSS, its growth over the RSS at its start, and CUDA."""
        self._fold()
        self._reset()
        start_rss, start_cuda = current_rss(), self._peak_cuda()
        record: dict[str, float] = {}
        started, cpu_started = time.perf_counter(), time.process_time()
        try:
            yield record
        finally:
            if self.cuda:
                import torch

                torch.cuda.synchronize()
            record["seconds"] = time.perf_counter() - started
            record["cpu_seconds"] = time.process_time() - cpu_started
            peak = self._peak_rss()
            record["peak_rss"] = peak
            record["peak_rss_growth"] = peak - start_rss
            record["end_rss"] = current_rss()
            if self.cuda:
                record["peak_cuda"] = self._peak_cuda()
                record["peak_cuda_growth"] = self._peak_cuda() - start_cuda
            self.phases[name] = record
            self._fold()
            self._reset()

    def finish(self) -> dict[str, Any]:
        """Process-wide peaks, and the peak growth over the RSS measured at creation."""
        self._fold()
        if self._sampler is not None:
            self._sampler.close()
        return {
            "baseline_rss": self.baseline_rss,
            "peak_rss": self.overall_rss,
            "peak_rss_growth": self.overall_rss - self.baseline_rss,
            "peak_cuda": self.overall_cuda if self.cuda else None,
            "exact_hwm": self._exact,
            "phases": self.phases,
        }


def run_isolated(fn: Callable[..., Any], *args: Any, isolate: bool = True, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` in a fresh spawned interpreter and return its result.

    A fresh process per phase keeps one phase's allocator state and imports out of another's
    peak memory. ``isolate=False`` runs it here instead (the smoke test: same code, no
    interpreter start-ups, meaningless peaks).
    """
    if not isolate:
        return fn(*args, **kwargs)
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()


CLOCK_ENV = "DARTS_BENCH_CLOCK"


def clock() -> Callable[[], float]:
    """The clock comparisons use: this process's CPU time, or wall time.

    With one CPU thread, CPU time counts exactly the work done and none of the time the process
    waits for a core that other jobs hold, so on a shared machine it is several times less noisy
    than wall time (measured: hf vs hf-darts generation rounds varied 0.24-0.52 s in wall time,
    0.29-0.37 s in CPU time). GPU runs and multi-threaded CPU runs use wall time.
    """
    return time.process_time if os.environ.get(CLOCK_ENV) == "cpu" else time.perf_counter


def choose_clock(device: str, threads: int) -> str:
    """``cpu`` for single-threaded CPU runs, else ``wall``; exported to spawned children."""
    name = "cpu" if not device.startswith("cuda") and threads == 1 else "wall"
    os.environ[CLOCK_ENV] = name
    return name


def alternate(
    contenders: dict[str, Callable[[], Any]], repeats: int, sync: Callable[[], None] | None = None
) -> dict[str, list[float]]:
    """Times of each contender over ``repeats`` rounds, order flipped every round (ABBA)."""
    now = clock()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(repeats):
        for name in names if round_ % 2 == 0 else names[::-1]:
            if sync:
                sync()
            started = now()
            contenders[name]()
            if sync:
                sync()
            times[name].append(now() - started)
    return times


def paired_ratio(times: dict[str, list[float]], ours: str, baseline: str) -> dict[str, float]:
    """Median of the per-round ratios (neighbours in time share the machine's state), with the
    medians of each side and the ratio of the fastest runs as a cross-check."""
    pairs = [a / b for a, b in zip(times[ours], times[baseline], strict=True) if b > 0]
    quartiles = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3 or [math.nan] * 3
    return {
        "ratio": statistics.median(pairs) if pairs else math.nan,
        "ratio_q1": quartiles[0],
        "ratio_q3": quartiles[2],
        f"{ours}_rounds_s": [round(t, 4) for t in times[ours]],
        f"{baseline}_rounds_s": [round(t, 4) for t in times[baseline]],
        "ratio_of_fastest": min(times[ours]) / min(times[baseline]),
        f"{ours}_s": statistics.median(times[ours]),
        f"{baseline}_s": statistics.median(times[baseline]),
        "rounds": len(pairs),
    }


def machine_info(device: str) -> dict[str, Any]:
    """What the numbers were measured on, including how busy the machine was."""
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "loadavg_start": _loadavg(),
    }
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / GiB, 1)
    except ImportError:
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def loadavg() -> list[float] | None:
    return _loadavg()


def choose_threads(requested: int, device: str) -> tuple[int | None, str]:
    """Threads for torch, and why: ``--threads`` (0 = torch's default), else 1 on CPU.

    On a CPU shared with other jobs every intra-op parallel region waits for its slowest
    thread, and a descheduled thread stalls the many tiny ops of the training loop and of
    decoding for a whole time slice: measured on these 2-core machines, 3 ms training steps
    became 30-160 ms with 2 threads under a load average of 5, and the same generate call took
    0.6-5.5 s; with 1 thread they stayed at 4-6 ms and within 30 %. Ratios compare two runs
    under the same setting, so they do not depend on it.
    """
    if requested > 0:
        return requested, "--threads"
    if requested == 0:
        return None, "torch default (--threads 0)"
    if device.startswith("cuda"):
        return None, "torch default (GPU run)"
    return 1, "1 on CPU: stable timings on a shared machine; --threads 0 for torch's default"


def apply_threads(threads: int | None) -> int:
    """Set torch's thread count here and, through the environment, in spawned children."""
    import torch

    if threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = str(threads)
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def cuda_sync(device: str) -> Callable[[], None] | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.synchronize


def quiet() -> None:
    """No progress bars or info logs from the libraries inside a measured process."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def warm_imports() -> None:
    """Import what loading a Llama pulls in lazily, so it is not counted as a phase's memory."""
    import transformers.models.llama.modeling_llama  # noqa: F401
    from transformers import AutoModelForCausalLM  # noqa: F401
