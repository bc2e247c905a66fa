"""lm-eval runs of the demo, cached, with each item's correctness kept for paired comparisons
(and, on the long scale, each item's per-token accuracy)."""

from __future__ import annotations

import functools
import hashlib
import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from demo.configs import LONG, METHODS, lm_eval_task
from demo.domains import DOMAIN_NAMES
from demo.family_io import IGNORED_PATTERNS, FamilyPaths

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

    @property
    def long_answers(self) -> bool:
        """The long scale: answers of 50+ tokens, where exact match says little about how much
        of an answer a merge keeps, so its table adds per-token accuracy and Δ vs Standard + L1."""
        return self.scale == LONG


@dataclass(frozen=True)
class Evaluation:
    """Exact match (%) per domain and each item's correctness (by lm-eval doc_id), for pairing;
    on the long scale also each item's per-token accuracy (0-1, same order; empty elsewhere)."""

    scores: dict[str, float]
    items: dict[str, list[int]]
    tokens: dict[str, list[float]] = field(default_factory=dict)

    @property
    def n_items(self) -> dict[str, int]:
        return {d: len(v) for d, v in self.items.items()}

    @property
    def token_scores(self) -> dict[str, float]:
        """Per-token accuracy (%) per domain: the mean over items."""
        return {d: 100 * statistics.fmean(v) for d, v in self.tokens.items()}


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
    """Exact match per domain through lm-eval (in-process: same code path as `lm_eval`), and
    per-token accuracy on the long scale (a cached run without it is run again)."""
    cache = (
        settings.out / "evals" / f"{digest([model, model_args, cache_key, settings.limit])}.json"
    )
    if not settings.fresh and cache.is_file():
        cached = Evaluation(**json.loads(cache.read_text()))
        if cached.tokens or not settings.long_answers:
            return cached
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
    samples = {d: output["samples"][lm_eval_task(d)] for d in DOMAIN_NAMES}
    items = {d: _correct(samples[d]) for d in DOMAIN_NAMES}
    tokens: dict[str, list[float]] = {}
    if settings.long_answers:
        tokenizer = _tokenizer(str(family.base))
        tokens = {d: token_accuracy(samples[d], tokenizer) for d in DOMAIN_NAMES}
    result = Evaluation({d: 100 * sum(v) / len(v) for d, v in items.items()}, items, tokens)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(asdict(result)))
    return result


def _correct(samples: list[dict[str, Any]]) -> list[int]:
    """1/0 exact match per item, in document order (the same order for every model)."""
    return [int(s["exact_match"]) for s in sorted(samples, key=lambda s: s["doc_id"])]


def token_accuracy(samples: Sequence[dict[str, Any]], tokenizer: Any) -> list[float]:
    """Per item, in document order: the share of the reference answer's tokens that the
    generation has at the same position. Both are seen as exact match sees them: the generation
    cut at the request's stop strings (the end of turn), both without the ignored patterns
    (leading and trailing whitespace); a generation shorter than the answer misses the rest."""
    shares = []
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        generation = sample["filtered_resps"][0]
        for stop in sample["arguments"][0][1].get("until", []):
            generation = generation.split(stop)[0]
        answer, said = (_encode(tokenizer, text) for text in (sample["target"], generation))
        if not answer:
            raise ValueError(f"item {sample['doc_id']} has an empty answer: nothing to score")
        shares.append(sum(a == b for a, b in zip(answer, said, strict=False)) / len(answer))
    return shares


def _encode(tokenizer: Any, text: str) -> list[int]:
    for pattern in IGNORED_PATTERNS:
        text = re.sub(pattern, "", text)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@functools.cache
def _tokenizer(folder: str) -> Any:
    """The family's tokenizer (the base model's), loaded once per process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@functools.cache
def _task_manager(include_path: str):
    """One task index for all evaluations: building it scans every lm-eval task (seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, verbosity="ERROR")
