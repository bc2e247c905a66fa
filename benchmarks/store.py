"""Calibrate once, train many: what a sweep's cells cost beyond training, and how many loads.

- **Sweep overhead.** An 8-cell sweep (module x loss x seed) through the sweep's own
  ``calibrate`` with one shared capture store, against one capture of each model plus 8 bare
  ``train_surgery`` loops on those captures: everything a cell adds (validation, its folder,
  manifest, diagnostics) over the training it cannot avoid. Target <= 1.2.
- **Model loads**, counted by a wrapper around ``AutoModelForCausalLM.from_pretrained`` that calls
  the real one: a block shaped like the demo's (15 tasks over 3 targets, with and without
  completions) and the captures of a 3-merge grid (2 cells per merge), each next to what one
  load per task (the pre-store contract) would have cost.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.calibration import load, ratio
from benchmarks.measure import alternate, cuda_sync, paired_ratio
from mergekit_darts.config.schema import DEFAULT_FOLDS

GRID = {"module": ["standard", "pos_corr"], "loss": ["l1", "ewl1"], "seed": [0, 1]}
TARGET_RATIO = 1.2
TARGETS = ("target", "target_b", "target_c")


@contextmanager
def counted_loads() -> Iterator[list[str]]:
    """Folder names of the models loaded inside the block (the real ``from_pretrained`` runs)."""
    from transformers import AutoModelForCausalLM

    loaded: list[str] = []
    original = AutoModelForCausalLM.from_pretrained

    def counting(path: Any, *args: Any, **kwargs: Any) -> Any:
        loaded.append(Path(str(path)).name)
        return original(path, *args, **kwargs)

    AutoModelForCausalLM.from_pretrained = counting
    try:
        yield loaded
    finally:
        AutoModelForCausalLM.from_pretrained = original


def _targets(pair: Any, workdir: Path) -> list[str]:
    """Three distinct targets: the pair's and two copies (a copy is another model to the store)."""
    folders = [pair.target]
    for name in TARGETS[1:]:
        folder = workdir / name
        if not folder.exists():
            shutil.copytree(pair.target, folder)
        folders.append(str(folder))
    return folders


def _block(settings: Any, targets: list[str], calib: str, *, small: bool = False) -> dict[str, Any]:
    """One task per target; ``small``: 8 prompts and 2 steps (a load count needs no training)."""
    n = min(settings.n, 8) if small else settings.n
    tasks = [
        {
            "name": f"t{i}",
            "target": target,
            "calibration": {"path": calib, "num_samples": n, "max_length": settings.max_length},
        }
        for i, target in enumerate(targets)
    ]
    return {
        "rank": settings.rank,
        "max_positions": settings.max_positions,
        "steps": 2 if small else settings.steps,
        "batch_size": settings.batch_size,
        "device": settings.device,
        "tasks": tasks,
    }


def sweep_overhead(settings: Any, merged: str, target: str, calib: str, workdir: Path) -> dict:
    """Paired times of the 8 cells through the sweep against 2 captures + 8 bare loops."""
    import torch
    from transformers import AutoTokenizer

    from mergekit_darts.analysis import sweep
    from mergekit_darts.calibrate.capture import capture
    from mergekit_darts.calibrate.data import tokenize_prompts
    from mergekit_darts.calibrate.runtime import pad_id
    from mergekit_darts.calibrate.store import CaptureStore
    from mergekit_darts.calibrate.train import TrainSettings, train_surgery
    from mergekit_darts.correction.modules import build_module

    base = _block(settings, [target], calib)
    cells = sweep.cells(GRID)
    tokenizer = AutoTokenizer.from_pretrained(merged)
    lines = Path(calib).read_text().splitlines()
    prompts = [json.loads(line)["text"] for line in lines if line][: settings.n]
    sequences = tokenize_prompts(
        tokenizer, prompts, max_length=settings.max_length, chat_template=False, key="bench"
    )
    pad = pad_id(tokenizer)

    def through_sweep() -> None:
        store = CaptureStore()  # cold each round: one capture of each model per round
        for cell in cells:
            folder = fresh_folder(workdir / "sweep" / sweep.cell_id(cell))
            sweep.cell_surgery(Path(merged), folder, sweep.cell_block(base, cell), store)

    def bare() -> None:
        grab = {}
        for name, path, entropy in (("target", target, True), ("merged", merged, False)):
            model = load(path, settings.device)
            grab[name] = capture(
                model,
                sequences,
                batch_size=settings.batch_size,
                with_entropy=entropy,
                cache_dtype=torch.bfloat16,
                cache_device=settings.device,
                pad_id=pad,
                progress=False,
            )
            del model
        hidden = grab["merged"].hidden.shape[-1]
        for cell in cells:
            module = build_module(
                cell["module"], hidden, settings.rank, settings.max_positions, seed=cell["seed"]
            )
            train = TrainSettings(
                loss=cell["loss"],
                steps=settings.steps,
                batch_size=settings.batch_size,
                seed=cell["seed"],
            )
            train_surgery(
                module,
                grab["merged"],
                grab["target"],
                train,
                device=settings.device,
                progress=False,
            )

    times = alternate(
        {"sweep": through_sweep, "bare": bare}, settings.repeats, cuda_sync(settings.device)
    )
    return paired_ratio(times, "sweep", "bare")


def demo_block_loads(settings: Any, merged: str, targets: list[str], calib: str) -> dict:
    """15 tasks over 3 targets, the demo's shape: 5 variants per target, 2 with completions."""
    from mergekit_darts.hosts.post_merge import run_surgery

    block = _block(settings, targets, calib, small=True)
    n = block["tasks"][0]["calibration"]["num_samples"]  # the smoke test has fewer than folds
    default = {"select": {"folds": min(DEFAULT_FOLDS, n)}}  # the default selection
    variants = [
        {"module": "standard", "loss": "l1"},
        {"loss": "l1"},
        default,
        {"module": "standard", "loss": "l1", "continuation": 4},
        {**default, "continuation": 4},
    ]
    tasks = []
    for v, variant in enumerate(variants):
        for task in block["tasks"]:
            task = {**task, "name": f"{task['name']}_v{v}", "eval_tasks": []}
            extra = dict(variant)
            if tokens := extra.pop("continuation", 0):
                task["calibration"] = {**task["calibration"], "continuation_tokens": tokens}
            tasks.append({**task, **extra})
    block["tasks"] = tasks
    with counted_loads() as loaded:
        run_surgery(merged, block, overwrite=True, progress=False, write_card=False)
    return {
        "tasks": len(tasks),
        "targets": len(targets),
        "loads": len(loaded),
        "one_per_task": len(tasks) + 1,
        "loaded": loaded,
    }


def grid_loads(settings: Any, pair: Any, targets: list[str], calib: str, workdir: Path) -> dict:
    """The captures of a 3-merge grid with 2 cells each: K targets + M merges loads."""
    import yaml

    from mergekit_darts.analysis import sweep
    from mergekit_darts.calibrate.store import CaptureStore

    # targets[1] is a copy of targets[0]: weights 0.3 keep every merge away from the target
    models = [{"model": t, "parameters": {"weight": 0.3, "density": 0.5}} for t in targets[:2]]
    configs = {
        "linear": {
            "merge_method": "linear",
            "models": [{"model": pair.merged, "parameters": {"weight": 0.5}}, models[0]],
        },
        "task_arithmetic": {"merge_method": "task_arithmetic", "base_model": pair.merged},
        "ties": {"merge_method": "ties", "base_model": pair.merged},
    }
    paths = []
    for name, config in configs.items():
        config = {"models": models, **config, "dtype": settings.model.dtype}
        path = workdir / "merges" / f"{name}.yml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config))
        paths.append(str(path))
    block = _block(settings, targets, calib, small=True)
    spec = sweep.SweepSpec(
        merges=paths,
        surgery=block,
        grid={"module": ["standard", "pos_corr"]},
        eval={"tasks": ["x"]},
    )
    merges = sweep.locate_merges(spec, workdir / "grid")
    folders = [sweep.make_merge(merge, log=lambda _line: None) for merge in merges]
    store = CaptureStore()
    cells = sweep.cells(spec.grid)
    with counted_loads() as loaded:
        for merge, folder in zip(merges, folders, strict=True):
            for cell in cells:
                cell_dir = fresh_folder(
                    workdir / "grid" / "cells" / f"{merge.name}__{sweep.cell_id(cell)}"
                )
                sweep.cell_surgery(folder, cell_dir, sweep.cell_block(block, cell), store)
    k, m = len(targets), len(merges)
    return {
        "targets": k,
        "merges": m,
        "cells_per_merge": len(cells),
        "loads": len(loaded),
        "one_per_task": m * len(cells) * (k + 1),
        "loaded": loaded,
    }


def run(settings: Any, pair: Any, workdir: Path, tick: Callable[[str], None]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from benchmarks.fixtures import calibration_texts, shadow_model, write_jsonl

    workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(pair.merged)
    calib = str(
        write_jsonl(
            workdir / "calibration.jsonl",
            calibration_texts(tokenizer, settings.n, settings.max_length),
        )
    )
    merged = shadow_model(pair.merged, workdir / "merged")
    targets = _targets(pair, workdir)
    tick("store: 8-cell sweep vs one capture per model + 8 bare training loops")
    overhead = sweep_overhead(settings, merged, pair.target, calib, workdir)
    tick("store: model loads of a demo-shaped block")
    demo = demo_block_loads(settings, merged, targets, calib)
    tick("store: model loads of a 3-merge grid")
    grid = grid_loads(settings, pair, targets, calib, workdir)
    name = "8-cell sweep capture + training / (one capture per model + 8 bare training loops)"
    return {
        "sweep": overhead,
        "demo_block": demo,
        "grid": grid,
        "ratios": {name: ratio(overhead["ratio"], TARGET_RATIO)},
    }


def fresh_folder(folder: Path) -> Path:
    """``folder``, empty: a cell's model folder is written once (the sweep stages each cell)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder
