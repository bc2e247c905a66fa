"""What every demo family shares: its folder layout, data and lm-eval task files, the stamp that
marks a build complete, and the pieces of a training step.

A family module (the tiny family in demo.family, the SmolLM2 one in demo.real_family) decides
how its models are trained and what identifies a build (its recipe hash); it lays the result out
with these functions, so the driver (demo.run) merges, calibrates and evaluates any family the
same way through `FamilyPaths`.
"""

from __future__ import annotations

import json
import multiprocessing
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
import yaml
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from demo.domains import DOMAIN_NAMES, Splits

STAMP = "family.json"
# One intra-op thread: a fixed reduction order keeps the weights identical from run to run,
# and OpenMP threads on a busy CPU slow a model this small down by up to 10x.
THREADS = 1

# what exact match removes from the generation and the answer before comparing them
IGNORED_PATTERNS = (r"^\s+", r"\s+$")

Labelled = tuple[list[int], list[int]]  # input ids and their labels (-100 = no loss)
Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class FamilyPaths:
    """Where a built family lives: model folders, data files and lm-eval task YAMLs."""

    root: Path
    base: Path
    experts: dict[str, Path]
    data: Path
    tasks: Path

    @property
    def stamp(self) -> Path:
        """Written last; its text identifies the build (merge and evaluation caches key on it)."""
        return self.root / STAMP

    def calib_file(self, domain: str) -> Path:
        """Calibration prompts (`prompt` field) of `domain`."""
        return self.data / f"{domain}_calib.jsonl"

    def eval_file(self, domain: str) -> Path:
        """Evaluation items (`prompt`, `answer`) of `domain`."""
        return self.data / f"{domain}_eval.jsonl"


def family_paths(root: Path) -> FamilyPaths:
    """The fixed layout under `root`."""
    experts = {d: root / "experts" / d for d in DOMAIN_NAMES}
    return FamilyPaths(root, root / "base", experts, root / "data", root / "tasks")


def is_complete(paths: FamilyPaths, recipe_hash: str) -> bool:
    """True when the stamp (written last) matches and every artifact is present."""
    stamp = paths.stamp
    if not stamp.is_file() or json.loads(stamp.read_text()).get("recipe_hash") != recipe_hash:
        return False
    models = [paths.base, *paths.experts.values()]
    files = [m / name for m in models for name in ("model.safetensors", "tokenizer.json")]
    files += [where(d) for d in DOMAIN_NAMES for where in (paths.calib_file, paths.eval_file)]
    return all(f.is_file() for f in files)


@contextmanager
def build_environment(progress: bool) -> Iterator[None]:
    """Fixed thread count and, when `progress` is off, no transformers bars; restored after."""
    threads, bars = torch.get_num_threads(), hf_logging.is_progress_bar_enabled()
    torch.set_num_threads(THREADS)
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if bars and not progress:
            hf_logging.enable_progress_bar()


def train_experts(
    paths: FamilyPaths,
    train: Callable[[str, frozenset[str], int | None], float],
    held_out: Mapping[str, frozenset[str]],
    progress: bool,
) -> dict[str, float]:
    """`train(domain, held_out[domain], bar)` for every expert at once, one process each; their
    last losses. `bar` is the terminal line of the process's step bar (None: no bar). Each process
    is single-threaded, so an expert gets the bits a sequential build would."""
    if progress:
        tqdm.write(f"training the {len(paths.experts)} experts, one process each")
    # spawn: a fresh interpreter that starts torch under this process's environment (the pins)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(paths.experts), mp_context=context) as pool:
        futures = {
            d: pool.submit(train, d, held_out[d], line if progress else None)
            for line, d in enumerate(paths.experts)
        }
        return {domain: future.result() for domain, future in futures.items()}


def write_data(paths: FamilyPaths, splits: Mapping[str, Splits]) -> None:
    """Calibration prompts and evaluation items as JSON lines, one file pair per domain."""
    paths.data.mkdir(parents=True, exist_ok=True)
    for domain, split in splits.items():
        _write_jsonl(paths.calib_file(domain), [{"prompt": ex.prompt} for ex in split.calib])
        _write_jsonl(paths.eval_file(domain), [asdict(ex) for ex in split.eval])


def _write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def write_tasks(paths: FamilyPaths, until: str, max_gen_toks: int) -> None:
    """One lm-eval task per domain (`demo_<domain>`), greedy generation up to `until` or
    `max_gen_toks` tokens, exact match. Rewritten only when changed (the YAMLs hold absolute
    paths: a family folder that moved gets them refreshed)."""
    paths.tasks.mkdir(parents=True, exist_ok=True)
    for domain in DOMAIN_NAMES:
        config = _task_config(domain, paths.eval_file(domain), until, max_gen_toks)
        text = yaml.safe_dump(config, sort_keys=False)
        target = paths.tasks / f"demo_{domain}.yaml"
        if not target.is_file() or target.read_text() != text:
            target.write_text(text)


def _task_config(domain: str, eval_file: Path, until: str, max_gen_toks: int) -> dict[str, object]:
    """lm-eval 0.4 task dict; data path absolute because lm-eval resolves it from the cwd."""
    return {
        "task": f"demo_{domain}",
        "tag": ["darts_demo"],
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(eval_file)}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{prompt}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {
            "until": [until],
            "do_sample": False,
            "max_gen_toks": max_gen_toks,
        },
        "metric_list": [
            {
                "metric": "exact_match",
                "aggregation": "mean",
                "higher_is_better": True,
                "regexes_to_ignore": list(IGNORED_PATTERNS),
            }
        ],
        "metadata": {"version": 1.0},
    }


def collate(seqs: list[Labelled], pad_id: int) -> Batch:
    """Right-pad: with causal attention real tokens never see pads, so no mask is needed."""
    width = max(len(ids) for ids, _ in seqs)
    ids = [s + [pad_id] * (width - len(s)) for s, _ in seqs]
    labels = [lab + [-100] * (width - len(lab)) for _, lab in seqs]
    return torch.tensor(ids), torch.tensor(labels)


def optimizer_step(
    loss: torch.Tensor,
    parameters: Iterable[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    schedule: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Backward, clip the gradient norm to 1, step the optimizer and the schedule, clear grads."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(parameters, 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """safetensors weights, config, greedy generation config and the tokenizer."""
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_stamp(
    paths: FamilyPaths,
    recipe: Any,  # the family's recipe dataclass
    seed: int,
    scale: str,
    recipe_hash: str,
    losses: dict[str, float],
    seconds: float,
) -> None:
    """Written last: its presence marks the build as complete."""
    stamp = {
        "recipe_hash": recipe_hash,
        "seed": seed,
        "scale": scale,
        "recipe": asdict(recipe),
        "final_loss": losses,
        "build_seconds": round(seconds, 1),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    partial = paths.root / f"{STAMP}.tmp"
    partial.write_text(json.dumps(stamp, indent=2) + "\n")
    partial.replace(paths.stamp)
