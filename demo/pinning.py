"""Pin what decides float rounding, so the demo prints one table on machines of one CPU vendor.

The family trains for ~3900 steps and small rounding differences between kernel sets (AVX2 vs
AVX-512 in torch, MKL's per-CPU code paths) or reduction orders (thread counts) grow into
different models. These variables are read once, when torch, MKL and OpenMP initialise, so they
must be in the environment before the first ``import torch`` of every process: the driver
re-executes itself when they are missing (see :func:`reexec_if_unpinned`) and passes them to
subprocesses.

Every matmul of the demo is MKL's SGEMM. MKL honours an instruction-set branch of ``MKL_CBWR``
(``AVX2``, ``AVX512``) only on Intel CPUs: elsewhere (AMD) it silently runs its automatic
dispatch, whose code path depends on the CPU. ``COMPATIBLE`` is the one branch MKL applies on
every x86-64 CPU, so it is the pin; :func:`apply_in_process` records the branch MKL reports.
Not covered: CPUs without AVX2 and other families (ARM), where these kernels do not exist; and an
Intel Xeon still builds other weights than an AMD EPYC (docs/demo.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PINS: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",  # torch's CPU kernel set
    "MKL_CBWR": "COMPATIBLE",  # MKL's code path: the only branch MKL applies on non-Intel CPUs
    "ONEDNN_MAX_CPU_ISA": "AVX2",  # oneDNN (mkldnn) instruction set
    "DNNL_MAX_CPU_ISA": "AVX2",  # the same, older spelling
    "OMP_NUM_THREADS": "1",  # one thread: a fixed reduction order (and faster on tiny models)
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_DYNAMIC": "FALSE",
}
REEXEC_MARK = "DARTS_DEMO_PINNED"
CHECKOUT = Path(__file__).resolve().parents[1]  # the folder that holds the demo package
# mkl_cbwr_get(MKL_CBWR_BRANCH) values (mkl_service.h)
MKL_BRANCHES = {0: "OFF", 1: "BRANCH_OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 10: "AVX2"}


def unpinned(env: Mapping[str, str]) -> dict[str, str | None]:
    """Variables of `env` that differ from the pins (their current value, None when unset)."""
    return {k: env.get(k) for k, v in PINS.items() if env.get(k) != v}


def pinned_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the pins forced, whatever it said: the environment every demo process gets."""
    return {**env, **PINS}


def reexec_if_unpinned(module: str, argv: Sequence[str]) -> None:
    """Replace this process with a pinned one running `python -m module argv` (before torch).

    The checkout that holds this package goes first on its PYTHONPATH (and so on that of every
    process it starts): `module`, and the `mergekit-yaml` runs, import this checkout's code
    whatever the working directory."""
    if not unpinned(os.environ):
        return
    if "torch" in sys.modules or os.environ.get(REEXEC_MARK):
        raise RuntimeError("the demo's pins must be set before torch is imported")
    path = [str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**pinned_env(os.environ), REEXEC_MARK: "1", "PYTHONPATH": os.pathsep.join(path)}
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def mkl_branch() -> str | None:
    """The code branch MKL (inside torch) actually runs, or None when torch has no MKL."""
    import torch

    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    with contextlib.suppress(OSError, AttributeError):
        code = int(ctypes.CDLL(str(lib)).mkl_serv_cbwr_get(1))  # 1: MKL_CBWR_BRANCH
        return MKL_BRANCHES.get(code, str(code))
    return None


def apply_in_process() -> dict[str, Any]:
    """Pin this process's torch threads and report what the runtime actually uses.

    `pinned_before_torch` is False when this process started without the pins (e.g. the demo
    called from Python rather than `python -m demo`): its kernel set was fixed
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
        "mkl_branch": mkl_branch(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
    }
