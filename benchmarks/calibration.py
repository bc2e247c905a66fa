"""Calibration cost (paper Table 8) and the baselines it is judged against.

Every function whose name starts with ``phase_`` runs in its own spawned interpreter (see
:func:`benchmarks.measure.run_isolated`), so its peak memory is its own. The Table 8 numbers come
from the real post-merge step, :func:`mergekit_darts.hosts.post_merge.run_surgery`, with
its three phases wrapped by a peak-memory tracker (its public ``on_phase`` callback); the
baselines (bare forward passes, a bare Adam loop, both models loaded at once) use the same token
sequences, batch size and cache dtype.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import heads
from benchmarks.fixtures import model_file_bytes, shadow_model
from benchmarks.measure import (
    CLOCK_ENV,
    PeakTracker,
    alternate,
    clock,
    cuda_sync,
    paired_ratio,
    quiet,
    warm_imports,
)
from mergekit_darts.config.schema import DEFAULT_FOLDS, DEFAULT_HOLDOUT

CACHE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def load(path: str, device: str) -> Any:
    """Load a model the way the pipeline does: saved dtype, on ``device``."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype="auto", device_map=device).eval()


def cache_bytes(n: int, width: int, hidden: int, cache_dtype: str = "bfloat16") -> int:
    """The two captures' tensors: hidden states [N,T,H] twice, masks [N,T] twice, entropy [N,T]."""
    return n * width * (2 * hidden * CACHE_DTYPE_BYTES[cache_dtype] + 2 + 4)


# The selections whose training phase is timed against one paper-recipe (DARTS) training: the
# block's default (cross-fitting over folds with the graded outcome) and one held-out share.
SELECTIONS = {
    "folds, the default": {},
    "holdout": {"holdout": DEFAULT_HOLDOUT},
}
CROSS_FIT_TARGET = 2.0  # the aim for cross-fitting's training phase, as a multiple of one training
# the aim for the default's whole post-merge step (capture, the targets' completions, training,
# judging, writing), as a multiple of the same step with `select: off` (DARTS, the paper's recipe)
END_TO_END_TARGET = 2.0
END_TO_END_ROUNDS = 3  # alternated pairs of runs; the median of their ratios counts
PLAIN_FITS = ("head", "norm")  # the plain kinds, timed against one DARTS training
STACKED_FOLDS = DEFAULT_FOLDS


# ---- the real pipeline, one task -----------------------------------------------------------------


def phase_pipeline(merged: str, block: dict[str, Any], device: str) -> dict[str, Any]:
    """Run ``run_surgery`` for one task and return Table 8's rows for it."""
    quiet()
    import time

    from safetensors.torch import load_file

    from mergekit_darts import run_surgery
    from mergekit_darts.folder.diagnostics import read_token_ids

    warm_imports()
    task = block["tasks"][0]["name"]
    tracker = PeakTracker(cuda=device.startswith("cuda"))
    started, cpu_started = time.perf_counter(), time.process_time()
    manifest = run_surgery(
        merged, block, overwrite=True, progress=False, write_card=False, on_phase=tracker.phase
    )
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    memory = tracker.finish()
    entry = manifest["tasks"][task]
    folder = Path(merged) / "surgery"
    module_file = folder / entry["file"]
    params = sum(t.numel() for t in load_file(module_file).values())
    _, mask = read_token_ids(folder / entry["diagnostics"])
    n, width = mask.shape
    timings = entry["timings"]
    load_merged = manifest["timings"]["load_merged_s"]
    return {
        "module": entry["module"],
        "load_merged_s": load_merged,
        "load_target_s": timings["load_target_s"],
        "capture_merged_s": timings["capture_merged_s"],
        "capture_target_s": timings["capture_target_s"],
        "precompute_s": timings["capture_merged_s"] + timings["capture_target_s"],
        "train_s": timings["train_s"],
        "total_s": wall,
        "total_cpu_s": cpu,
        "manifest_total_s": manifest["timings"]["total_s"],
        "memory": memory,
        "n": int(n),
        "width": int(width),
        "tokens": int(mask.sum()),
        "hidden": int(manifest["hidden_size"]),
        "cache_bytes": cache_bytes(int(n), int(width), int(manifest["hidden_size"])),
        "params": int(params),
        "file_bytes": module_file.stat().st_size,
        "rho_l1": entry["metrics"]["rho_l1"],
        "model_bytes": max(model_file_bytes(merged), model_file_bytes(block["tasks"][0]["target"])),
        # where the step's time went, stage by stage (the manifest's timings; select_* and
        # refit_s lie inside train_s)
        "stages": {"load_merged_s": load_merged, **{k: round(v, 3) for k, v in timings.items()}},
    }


# ---- peak memory of the alternatives -------------------------------------------------------------


def phase_naive(
    merged: str, target: str, sequences: list[list[int]], settings: dict[str, Any]
) -> dict[str, Any]:
    """The paper's way: merged and target loaded together, then the same two captures.

    Training is left out: it adds a few MB at most (see the pipeline's train phase), and the
    peak of this approach is in the captures.
    """
    quiet()
    import torch

    from mergekit_darts.calibrate.capture import capture

    warm_imports()
    device = settings["device"]
    tracker = PeakTracker(cuda=device.startswith("cuda"))
    with tracker.phase("load_both"):
        models = load(merged, device), load(target, device)
    with tracker.phase("precompute"):
        common = dict(
            batch_size=settings["batch_size"],
            cache_device=device,
            cache_dtype=torch.bfloat16,
            pad_id=settings["pad_id"],
            progress=False,
        )
        kept = [capture(models[0], sequences, **common)]  # both caches stay, as for training
        kept.append(capture(models[1], sequences, with_entropy=True, **common))
    return tracker.finish()


def phase_capture_memory(
    path: str, sequences: list[list[int]], with_entropy: bool, device: str, batch_size: int
) -> dict[str, Any]:
    """Peak growth of one capture (entropy or not) over the loaded model, in a fresh process."""
    quiet()
    import torch

    from mergekit_darts.calibrate.capture import capture

    warm_imports()
    model = load(path, device)
    tracker = PeakTracker(cuda=device.startswith("cuda"))
    with tracker.phase("capture") as record:
        captured = capture(
            model,
            sequences,
            batch_size=batch_size,
            with_entropy=with_entropy,
            cache_dtype=torch.bfloat16,
            cache_device=device,
            progress=False,
        )
        record["cache_bytes"] = captured.nbytes
    return tracker.finish()


# ---- time baselines ------------------------------------------------------------------------------


def bare_passes(models: tuple[Any, ...], sequences: list[list[int]], batch_size: int, pad: int):
    """The floor for precompute: each model's plain forward over the same padded batches."""
    import torch

    from mergekit_darts.calibrate.capture import input_device, pad_batch

    with torch.no_grad():
        for model in models:
            device = input_device(model)
            for start in range(0, len(sequences), batch_size):
                ids, mask = pad_batch(sequences[start : start + batch_size], pad)
                model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)


def bare_adam_loop(module: Any, merged: Any, target: Any, steps: int, batch_size: int, seed: int):
    """The floor for training: the product's optimizer steps back to back.

    The same batches in the same order as ``train_surgery``, each one
    :func:`~mergekit_darts.calibrate.train.optimizer_step`; none of the loop's checks, loss
    logging, progress bar or final evaluation.
    """
    import torch

    from mergekit_darts.calibrate.train import TrainSettings, adam, epoch_batches, optimizer_step

    settings = TrainSettings(steps=steps, batch_size=batch_size, seed=seed)
    device = merged.hidden.device
    module = module.to(device=device, dtype=torch.float32).train()
    optimizer = adam(list(module.parameters()), settings)
    counted = merged.mask.to(torch.bool)
    batches = epoch_batches(
        torch.arange(merged.hidden.shape[0]), batch_size, torch.Generator().manual_seed(seed)
    )
    for _ in range(steps):
        batch = next(batches).to(device)
        optimizer_step(module, optimizer, merged, target, batch, counted, settings.loss)
    return module


def _time(fn: Callable[[], Any], sync: Callable[[], None] | None) -> float:
    now = clock()
    started = now()
    fn()
    if sync:
        sync()
    return now() - started


def phase_time_baselines(
    merged: str, target: str, sequences: list[list[int]], settings: dict[str, Any]
) -> dict[str, Any]:
    """Precompute vs two bare passes, and training vs a bare Adam loop, interleaved."""
    quiet()
    import torch

    from mergekit_darts import build_module
    from mergekit_darts.calibrate.capture import capture
    from mergekit_darts.calibrate.train import TrainSettings, measure_bias, train_surgery

    device, batch, repeats = settings["device"], settings["batch_size"], settings["repeats"]
    steps, pad = settings["steps"], settings["pad_id"]
    models = load(merged, device), load(target, device)
    common = dict(batch_size=batch, cache_device=device, pad_id=pad, progress=False)
    held: dict[str, Any] = {}

    def precompute() -> None:
        held["merged"] = capture(models[0], sequences, cache_dtype=torch.bfloat16, **common)
        held["target"] = capture(
            models[1], sequences, with_entropy=True, cache_dtype=torch.bfloat16, **common
        )

    sync = cuda_sync(device)
    bare_passes(models, sequences[:batch], batch, pad)  # warm-up: first-call allocations
    precompute_times = alternate(
        {
            "precompute": precompute,
            "bare_passes": lambda: bare_passes(models, sequences, batch, pad),
        },
        repeats,
        sync,
    )
    result: dict[str, Any] = {
        "precompute": paired_ratio(precompute_times, "precompute", "bare_passes")
    }
    hidden = held["merged"].hidden.shape[-1]
    train_settings = TrainSettings(steps=steps, batch_size=batch)
    for kind in settings["kinds"]:
        final_eval: list[float] = []

        def ours(kind: str = kind, final_eval: list[float] = final_eval) -> None:
            module = build_module(kind, hidden, settings["rank"], settings["max_positions"], seed=0)
            out = train_surgery(
                module,
                held["merged"],
                held["target"],
                train_settings,
                device=device,
                progress=False,
            )
            merged_cap, target_cap = held["merged"], held["target"]
            final_eval.append(
                _time(
                    lambda: measure_bias(out.module, merged_cap, target_cap, merged_cap.mask), sync
                )
            )

        def bare(kind: str = kind) -> None:
            module = build_module(kind, hidden, settings["rank"], settings["max_positions"], seed=0)
            bare_adam_loop(module, held["merged"], held["target"], steps, batch, seed=0)

        times = alternate({"train_surgery": ours, "bare_adam": bare}, repeats, sync)
        call = paired_ratio(times, "train_surgery", "bare_adam")
        # The loop alone: train_surgery ends with one evaluation over every token, timed again
        # right after each call with the same clock and taken off.
        times["train_loop"] = [
            t - e for t, e in zip(times.pop("train_surgery"), final_eval, strict=True)
        ]
        loop = paired_ratio(times, "train_loop", "bare_adam")
        result[f"train_{kind}"] = {**loop, "call_ratio": call["ratio"]}
    result["stacked_folds"] = _stacked_against_one_by_one(held, hidden, train_settings, settings)
    for kind in PLAIN_FITS:
        result[f"plain_{kind}"] = _plain_against_darts(held, hidden, kind, train_settings, settings)
    return result


def _plain_against_darts(
    held: dict[str, Any], hidden: int, kind: str, train_settings: Any, settings: dict[str, Any]
) -> dict[str, Any]:
    """A plain kind's closed-form fit against one DARTS training (pos_corr + EWL1, the block's
    steps), both through train_surgery on the same captures, interleaved."""
    from mergekit_darts import build_module
    from mergekit_darts.calibrate.train import train_surgery

    shape = (hidden, settings["rank"], settings["max_positions"])

    def fit(kind: str) -> None:
        module = build_module(kind, *shape, seed=0)
        train_surgery(
            module,
            held["merged"],
            held["target"],
            train_settings,
            device=settings["device"],
            progress=False,
        )

    times = alternate(
        {kind: lambda: fit(kind), "darts": lambda: fit("pos_corr")},
        settings["repeats"],
        cuda_sync(settings["device"]),
    )
    return paired_ratio(times, kind, "darts")


def _stacked_against_one_by_one(
    held: dict[str, Any], hidden: int, train_settings: Any, settings: dict[str, Any]
) -> dict[str, Any]:
    """Cross-fitting's fits of one candidate (DARTS, 5 folds): together (train_stacked) against
    one after another (train_surgery per fold), interleaved, on this run's device."""

    from mergekit_darts import build_module
    from mergekit_darts.calibrate.selection import cross_fit_splits
    from mergekit_darts.calibrate.train import train_stacked, train_surgery

    n = held["merged"].hidden.shape[0]
    rows = [train for train, _ in cross_fit_splits(n, min(STACKED_FOLDS, n), 0)]
    device = settings["device"]
    shape = (hidden, settings["rank"], settings["max_positions"])

    def modules() -> list[Any]:
        return [build_module("pos_corr", *shape, seed=0) for _ in rows]

    def together() -> None:
        train_stacked(
            modules(),
            held["merged"],
            held["target"],
            train_settings,
            rows,
            device=device,
            progress=False,
        )

    def one_by_one() -> None:
        for module, r in zip(modules(), rows, strict=True):
            train_surgery(
                module,
                held["merged"],
                held["target"],
                train_settings,
                rows=r,
                device=device,
                progress=False,
            )

    times = alternate(
        {"stacked": together, "one_by_one": one_by_one}, settings["repeats"], cuda_sync(device)
    )
    return paired_ratio(times, "stacked", "one_by_one")


# ---- the whole section ---------------------------------------------------------------------------


def ratio(value: float, target: float | None, better: str = "lower") -> dict[str, Any]:
    """A ratio with its target and whether it was met (None when there is no target)."""
    met = None
    if target is not None and math.isfinite(value):
        met = value <= target if better == "lower" else value >= target
    return {"value": value, "target": target, "better": better, "met": met}


def memory_ratios(task: dict[str, Any], naive: dict[str, Any], logits_bytes: int) -> dict[str, Any]:
    """Peak memory growth over (largest single model + cache), ours and the naive way."""
    key = "peak_cuda" if task["memory"].get("peak_cuda") else "peak_rss_growth"
    floor = task["model_bytes"] + task["cache_bytes"]
    return {
        "excess_over_model_cache_bytes": task["memory"][key] - floor,
        "peak_over_model_cache": task["memory"][key] / floor,
        "peak_over_model_cache_logits": task["memory"][key] / (floor + logits_bytes),
        "naive_over_model_cache": naive[key] / floor,
        "key": key,
        "floor_bytes": floor,
    }


def run(settings: Any, pair: Any, workdir: Path, tick: Callable[[str], None]) -> dict[str, Any]:
    """Table 8 for each module kind, the memory comparisons, and the time baselines."""
    from transformers import AutoTokenizer

    from benchmarks.fixtures import calibration_texts, write_jsonl
    from benchmarks.measure import run_isolated
    from mergekit_darts.calibrate.data import tokenize_prompts

    tokenizer = AutoTokenizer.from_pretrained(pair.merged)
    texts = calibration_texts(tokenizer, settings.n, settings.max_length)
    calib = write_jsonl(workdir / "calibration.jsonl", texts)
    sequences = tokenize_prompts(
        tokenizer, texts, max_length=settings.max_length, chat_template=False, key="bench"
    )
    pad = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    view = settings.subprocess_view() | {"pad_id": pad}
    merged = shadow_model(pair.merged, workdir / "merged")

    def block_of(kind: str) -> dict[str, Any]:
        return settings.surgery_block(
            task="bench", target=pair.target, calibration=str(calib), module=kind
        )

    def timed(block: dict[str, Any]) -> dict[str, Any]:
        return run_isolated(
            phase_pipeline, merged, block, settings.device, isolate=settings.isolate
        )

    tasks = {}
    for kind in settings.kinds:
        tick(f"calibration: run_surgery, {kind}")
        tasks[kind] = timed(block_of(kind))
    selections = {}
    for label, select in SELECTIONS.items():
        tick(f"calibration: run_surgery, select ({label})")
        if "holdout" not in select:  # the smoke test calibrates on fewer prompts than folds
            select = {**select, "folds": min(DEFAULT_FOLDS, settings.n)}
        chosen = {k: v for k, v in block_of("pos_corr").items() if k not in ("module", "loss")}
        selections[label] = timed(chosen | {"select": select})
    default = {k: v for k, v in block_of("pos_corr").items() if k not in ("module", "loss")}
    if settings.n < DEFAULT_FOLDS:  # the smoke test calibrates on fewer prompts than folds
        default["select"] = {"folds": settings.n}
    end_to_end = _end_to_end(
        {"default": default, "select off": {**block_of("pos_corr"), "select": False}}, timed, tick
    )
    tick("calibration: target capture memory, with entropy")
    with_entropy = run_isolated(
        phase_capture_memory,
        pair.target,
        sequences,
        True,
        settings.device,
        settings.batch_size,
        isolate=settings.isolate,
    )
    tick("calibration: target capture memory, hidden states only")
    hidden_only = run_isolated(
        phase_capture_memory,
        pair.target,
        sequences,
        False,
        settings.device,
        settings.batch_size,
        isolate=settings.isolate,
    )
    tick("calibration: naive, both models loaded")
    naive = run_isolated(
        phase_naive, pair.merged, pair.target, sequences, view, isolate=settings.isolate
    )
    tick("calibration: time baselines (bare passes, bare Adam loop)")
    baselines = run_isolated(
        phase_time_baselines, pair.merged, pair.target, sequences, view, isolate=settings.isolate
    )
    found = summarise(tasks, with_entropy, hidden_only, naive, baselines, settings, len(tokenizer))
    found["selections"] = selections
    paper = tasks["pos_corr"]["train_s"] if "pos_corr" in tasks else None
    for label, selected in selections.items():
        found["ratios"][f"training phase of select ({label}) / one DARTS training"] = ratio(
            selected["train_s"] / paper if paper else float("nan"),
            CROSS_FIT_TARGET if "holdout" not in SELECTIONS[label] else None,
        )
    found["end_to_end"] = end_to_end
    found["ratios"]["whole post-merge step: the default / select: off (DARTS)"] = ratio(
        end_to_end["ratio"], END_TO_END_TARGET
    )
    found["heads"] = heads.run(settings, workdir, str(calib), tick)
    found["ratios"][f"peak memory / one float32 LM head, {heads.HEAD_TASKS} kl tasks"] = ratio(
        found["heads"]["peak_in_heads"], None
    )
    return found


def _end_to_end(
    blocks: dict[str, dict[str, Any]],
    timed: Callable[[dict[str, Any]], dict[str, Any]],
    tick: Callable[[str], None],
) -> dict[str, Any]:
    """The whole post-merge step of each block, alternated (ABBA) over
    :data:`END_TO_END_ROUNDS` rounds, each run in a fresh interpreter: the paired ratio of the
    first block to the second (the clock :func:`benchmarks.measure.clock` names: CPU time with
    one thread), and each block's stages from its last run."""
    key = "total_cpu_s" if os.environ.get(CLOCK_ENV) == "cpu" else "total_s"
    names = list(blocks)
    times: dict[str, list[float]] = {name: [] for name in names}
    stages: dict[str, dict[str, float]] = {}
    for round_ in range(END_TO_END_ROUNDS):
        for name in names if round_ % 2 == 0 else names[::-1]:
            tick(f"calibration: end to end, {name} (round {round_ + 1})")
            found = timed(blocks[name])
            times[name].append(found[key])
            stages[name] = {**found["stages"], key: found[key]}
    return {**paired_ratio(times, *names), "stages": stages, "clock": key}


def summarise(
    tasks: dict[str, Any],
    with_entropy: dict[str, Any],
    hidden_only: dict[str, Any],
    naive: dict[str, Any],
    baselines: dict[str, Any],
    settings: Any,
    vocab: int,
) -> dict[str, Any]:
    first = next(iter(tasks.values()))
    n, width = first["n"], first["width"]
    dtype_bytes = CACHE_DTYPE_BYTES.get(settings.model.dtype, 4)
    logits_batch = min(settings.batch_size, n) * width * vocab * dtype_bytes
    growth = "peak_cuda_growth" if settings.device.startswith("cuda") else "peak_rss_growth"
    entropy_extra = (
        with_entropy["phases"]["capture"][growth] - hidden_only["phases"]["capture"][growth]
    )
    ntv = n * width * vocab * 4
    entropy = {
        "vocab": vocab,
        "capture_with_entropy_growth": with_entropy["phases"]["capture"][growth],
        "capture_hidden_only_growth": hidden_only["phases"]["capture"][growth],
        "entropy_extra_bytes": entropy_extra,
        "ntv_float32_bytes": ntv,
        "one_batch_logits_bytes": logits_batch,
    }
    ratios: dict[str, Any] = {
        "precompute / 2 bare forward passes": ratio(baselines["precompute"]["ratio"], 1.3),
    }
    for kind in tasks:
        ratios[f"training loop / bare Adam loop ({kind})"] = ratio(
            baselines[f"train_{kind}"]["ratio"], 1.2
        )
    ratios[f"{STACKED_FOLDS} fold modules trained together / one by one (pos_corr)"] = ratio(
        baselines["stacked_folds"]["ratio"], None
    )
    for kind in PLAIN_FITS:  # a closed-form fit should cost a small fraction of one training
        ratios[f"{kind} closed-form fit / one DARTS training"] = ratio(
            baselines[f"plain_{kind}"]["ratio"], 0.25
        )
    for kind, task in tasks.items():
        mem = memory_ratios(task, naive, logits_batch)
        task["memory_ratios"] = mem
        ratios[f"peak memory / (largest model + cache) ({kind})"] = ratio(
            mem["peak_over_model_cache"], 1.2
        )
        ratios[f"peak memory / (model + cache + one batch of logits) ({kind})"] = ratio(
            mem["peak_over_model_cache_logits"], 1.2
        )
    ratios["naive both-loaded peak / (largest model + cache)"] = ratio(
        next(iter(tasks.values()))["memory_ratios"]["naive_over_model_cache"], None
    )
    ratios[f"entropy memory / N*T*V float32 tensor (V={vocab})"] = ratio(
        max(entropy_extra, 1) / ntv, 1.0
    )
    return {
        "tasks": tasks,
        "entropy": entropy,
        "naive": naive,
        "baselines": baselines,
        "ratios": ratios,
    }
