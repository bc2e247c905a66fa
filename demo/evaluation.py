"""lm-eval runs of the demo, cached, with each item's correctness kept for paired comparisons."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from demo.configs import METHODS, lm_eval_task
from demo.domains import DOMAIN_NAMES
from demo.family_io import FamilyPaths

console = Console()


@dataclass(frozen=True)
class DemoSettings:
    out: Path = Path("runs/demo")
    scale: str = "full"
    seed: int = 0
    methods: tuple[str, ...] = tuple(METHODS)
    steps: int = 500
    limit: int | None = None  # evaluation items per task (None: all)
    batch_size: int = 32
    fresh: bool = False  # recompute merges and evaluations even when cached
    full: bool = False  # ablation rows and the held-out-metric study too
    surgery_seeds: int = 1  # surgery seeds 0..n-1 per surgery row (the CLI's default is 3)


@dataclass(frozen=True)
class Evaluation:
    """Exact match (%) per domain and each item's correctness (by lm-eval doc_id), for pairing."""

    scores: dict[str, float]
    items: dict[str, list[int]]

    @property
    def n_items(self) -> dict[str, int]:
        return {d: len(v) for d, v in self.items.items()}


def digest(payload: Any) -> str:
    """Short stable hash of a JSON-able payload: cache keys."""
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def evaluate(
    settings: DemoSettings,
    family: FamilyPaths,
    model: str,
    model_args: str,
    cache_key: Any,
) -> Evaluation:
    """Exact match per domain through lm-eval (in-process: same code path as `lm_eval`)."""
    cache = (
        settings.out / "evals" / f"{digest([model, model_args, cache_key, settings.limit])}.json"
    )
    if not settings.fresh and cache.is_file():
        return Evaluation(**json.loads(cache.read_text()))
    import lm_eval

    tasks = [lm_eval_task(d) for d in DOMAIN_NAMES]
    console.print(
        f"[dim]lm_eval --model {model} --model_args {model_args} --tasks {','.join(tasks)} "
        f"--include_path {family.tasks} --batch_size {settings.batch_size} --log_samples[/dim]"
    )
    output = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=_task_manager(str(family.tasks)),
        batch_size=settings.batch_size,
        device="cpu",
        limit=settings.limit,
        log_samples=True,
        verbosity="ERROR",
    )
    items = {d: _correct(output["samples"][lm_eval_task(d)]) for d in DOMAIN_NAMES}
    result = Evaluation({d: 100 * sum(v) / len(v) for d, v in items.items()}, items)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(asdict(result)))
    return result


def _correct(samples: list[dict[str, Any]]) -> list[int]:
    """1/0 exact match per item, in document order (the same order for every model)."""
    return [int(s["exact_match"]) for s in sorted(samples, key=lambda s: s["doc_id"])]


@functools.cache
def _task_manager(include_path: str):
    """One task index for all evaluations: building it scans every lm-eval task (seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, verbosity="ERROR")
