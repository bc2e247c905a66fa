"""Everything one benchmark run is parameterised by, with defaults sized for a 2-core CPU.

The same fields, set from the command line, scale the run up to a 7B-shaped model on a GPU
(``--hidden 4096 --layers 32 --dtype bfloat16 --device cuda --max-length 512``) or point it at
real checkpoints (``--merged``/``--target``).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from benchmarks.fixtures import ModelSpec

SECTIONS = ("calibration", "store", "inference", "startup", "scaling")
DEFAULT_STARTUP = {
    "mergekit-yaml --help": (["mergekit-yaml", "--help"], 2),
    "lm_eval -h": (["lm_eval", "-h"], 10),
}


@dataclass(frozen=True)
class BenchSettings:
    model: ModelSpec = field(default_factory=ModelSpec)
    # calibration (paper protocol, except prompt length: 64..128 tokens instead of up to 512)
    n: int = 50
    max_length: int = 128
    max_positions: int = 512
    rank: int = 16
    steps: int = 500
    batch_size: int = 8
    kinds: tuple[str, ...] = ("standard", "pos_corr")
    device: str = "cpu"
    repeats: int = 2  # interleaved rounds per time ratio (the fastest round of each side counts)
    threads: int = -1  # torch threads: -1 = 1 on CPU (stable timings), 0 = torch default, n
    merged: str | None = None  # real checkpoints instead of random ones
    target: str | None = None
    # inference overhead
    inference_hidden: tuple[int, ...] = (512, 1024)
    ll_requests: int = 8
    ll_context: int = 64
    gen_requests: int = 4
    gen_tokens: int = 32
    inference_repeats: int = 9
    # startup hook: label -> (argv, repetitions)
    startup: dict[str, tuple[list[str], int]] = field(default_factory=lambda: dict(DEFAULT_STARTUP))
    # scaling sweeps around the calibration point (N, max_length, rank, hidden)
    scale_n: tuple[int, ...] = (10, 25, 50, 100)
    scale_t: tuple[int, ...] = (64, 128, 256, 512)
    scale_rank: tuple[int, ...] = (16, 32, 64, 128)
    scale_hidden: tuple[int, ...] = (256, 512, 1024)
    scale_steps: int = 100  # measured steps per point; the table extrapolates to ``steps``
    sections: tuple[str, ...] = SECTIONS
    results: str = "benchmarks/results"
    workdir: str | None = None
    progress: bool = True
    isolate: bool = True  # each memory/time phase in a fresh interpreter (False: smoke test)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def subprocess_view(self) -> dict[str, Any]:
        """The plain values a measuring subprocess needs."""
        return {
            "device": self.device,
            "batch_size": self.batch_size,
            "rank": self.rank,
            "max_positions": self.max_positions,
            "steps": self.steps,
            "repeats": self.repeats,
            "kinds": list(self.kinds),
        }

    def surgery_block(
        self, *, task: str, target: str, calibration: str, module: str
    ) -> dict[str, Any]:
        """The ``surgery:`` block of one task with these settings, as a mergekit YAML would hold it
        (``calibration``: a JSONL file with a ``text`` field)."""
        return {
            "module": module,
            "loss": "ewl1",
            "rank": self.rank,
            "max_positions": self.max_positions,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "device": self.device,
            "tasks": [
                {
                    "name": task,
                    "target": target,
                    "calibration": {
                        "path": calibration,
                        "field": "text",
                        "num_samples": self.n,
                        "max_length": self.max_length,
                    },
                }
            ],
        }


def tiny_settings(results: str, workdir: str | None = None) -> BenchSettings:
    """A minuscule run for the smoke test: every code path, no meaningful numbers."""
    return BenchSettings(
        model=ModelSpec(hidden=64, layers=1, vocab=256),
        n=4,
        max_length=12,
        max_positions=16,
        rank=4,
        steps=3,
        batch_size=2,
        repeats=1,
        inference_hidden=(64,),
        ll_requests=2,
        ll_context=6,
        gen_requests=1,
        gen_tokens=2,
        inference_repeats=1,
        startup={"python -c pass": ([sys.executable, "-c", "pass"], 1)},
        scale_n=(2, 4),
        scale_t=(8, 12),
        scale_rank=(2, 4),
        scale_hidden=(32, 64),
        scale_steps=2,
        results=results,
        workdir=workdir,
        progress=False,
        isolate=False,
    )


def with_model(settings: BenchSettings, **changes: Any) -> BenchSettings:
    return replace(settings, model=replace(settings.model, **changes))
