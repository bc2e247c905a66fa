"""Pin what decides float rounding, so the demo prints the same table on every x86-64 AVX2 CPU.

The family trains for ~2000 steps and small rounding differences between kernel sets (AVX2 vs
AVX-512 in torch, MKL and oneDNN) or reduction orders (thread counts) grow into different
models. These variables are read once, when torch, MKL and OpenMP initialise, so they must be
in the environment before the first ``import torch`` of every process: the driver re-executes
itself when they are missing (see :func:`reexec_if_unpinned`) and passes them to subprocesses.
Not covered: CPUs without AVX2 and other families (ARM), where these kernels do not exist.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

PINS: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's CPU kernel set
    "MKL_CBWR": "AVX2",  # MKL conditional numerical reproducibility
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (mkldnn) instruction set
    "DNNL_MAX_CPU_ISA": "AVX2",  # the same, older spelling
    "OMP_NUM_THREADS": "1",  # one thread: a fixed reduction order (and faster on tiny models)
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_DYNAMIC": "FALSE",
}
REEXEC_MARK = "DARTS_DEMO_PINNED"


def unpinned(env: Mapping[str, str]) -> dict[str, str | None]:
    """Variables of `env` that differ from the pins (their current value, None when unset)."""
    return {k: env.get(k) for k, v in PINS.items() if env.get(k) != v}


def pinned_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the pins forced, whatever it said: the environment every demo process gets."""
    return {**env, **PINS}


def reexec_if_unpinned(module: str, argv: Sequence[str]) -> None:
    """Replace this process with a pinned one running `python -m module argv` (before torch)."""
    if not unpinned(os.environ):
        return
    if "torch" in sys.modules or os.environ.get(REEXEC_MARK):
        raise RuntimeError("the demo's pins must be set before torch is imported")
    env = {**pinned_env(os.environ), REEXEC_MARK: "1"}
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def apply_in_process() -> dict[str, Any]:
    """Pin this process's torch threads and report what the runtime actually uses.

    `pinned_before_torch` is False when this process started without the pins (e.g. the demo
    called from Python rather than `python -m mergekit_darts.demo`): its kernel set was fixed
    then, so its numbers may differ from the README's.
    """
    import torch

    torch.set_num_threads(1)
    if torch.get_num_interop_threads() != 1:
        with contextlib.suppress(RuntimeError):  # only settable before any parallel work
            torch.set_num_interop_threads(1)
    return {
        "env": dict(PINS),
        "pinned_before_torch": not unpinned(os.environ),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
    }
