"""Test-only shim, on ``PYTHONPATH`` in the data-parallel tests: lm-eval counts CPU processes as GPUs.

lm-eval's HFLM takes its data-parallel branch (rank and world size from accelerate, requests split
across ranks, results gathered on rank 0) only when ``torch.cuda.device_count()`` exceeds one. In a
process started by a distributed launcher (``WORLD_SIZE`` set), this makes that one call, and only
when ``lm_eval.models.huggingface`` makes it, return the number of launched processes. Everything
else stays real: accelerate's CPU state and gloo process group, the device (CPU), lm-eval's
request split, padding and gather, and every other caller of ``device_count``.
"""

from __future__ import annotations

import os
import sys

if os.environ.get("WORLD_SIZE"):
    import torch

    _real_device_count = torch.cuda.device_count

    def _device_count(*args: object, **kwargs: object) -> int:
        if sys._getframe(1).f_globals.get("__name__") == "lm_eval.models.huggingface":
            return int(os.environ["WORLD_SIZE"])
        return _real_device_count(*args, **kwargs)

    torch.cuda.device_count = _device_count
