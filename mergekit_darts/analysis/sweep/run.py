"""Running a sweep: plan every cell up front, then each merge's cells, resumable after a kill.

Every cell is validated before anything runs. A cell whose ``result.json`` carries the same
fingerprint (merged model's path and weights, cell block, its targets' weights and calibration
files, eval settings, the eval tasks' config and data files, merge YAML) is skipped, so a killed
sweep loses only its unscored cells and a changed spec, merge, target, calibration file or eval
task file reruns exactly the cells it changes, each written anew and renamed over its old
folder. The cells share one capture store, so each model is loaded once for capture in the
whole sweep.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from mergekit_darts.analysis.sweep.cell import (
    BASELINE,
    MERGE,
    Cell,
    EvalModel,
    calibrate_cell,
    cell_block,
    cell_id,
    cells,
    evaluate_cell,
    fingerprint,
    inputs_identity,
    load_cell,
    tasks_identity,
)
from mergekit_darts.analysis.sweep.merges import Merge, locate_merges, make_merge
from mergekit_darts.analysis.sweep.spec import (
    SweepSpec,
    base_block,
    load_spec,
    output_dir,
)
from mergekit_darts.analysis.sweep.spec import cache_dir as block_cache_dir
from mergekit_darts.analysis.sweep.tables import write_results
from mergekit_darts.calibrate.store import CaptureStore
from mergekit_darts.config import parse_surgery
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.task_map import OTHER_WEIGHTS, parse_surgery_map, surgery_task_for

CELLS = "cells"  # <output>/cells/<cell id>/

Planned = list[tuple[dict[str, Any], dict[str, Any] | None]]


def plan(spec: SweepSpec) -> Planned:
    """(settings, surgery block or None for the baseline) of every cell, all validated up front."""
    base = base_block(spec)
    planned: Planned = []
    if spec.baseline:
        planned.append((dict(BASELINE), None))
    for settings in cells(spec.grid):
        block = cell_block(base, settings)
        try:
            parse_surgery(block)
        except SurgeryConfigError as err:
            raise SurgeryConfigError(f"sweep cell {cell_id(settings)}: {err}") from None
        planned.append((settings, block))
    check_served(spec, base)
    check_weights_args(spec)
    return planned


def check_weights_args(spec: SweepSpec) -> None:
    """No ``hf-darts`` argument that changes the merged weights the cells' surgeries fit."""
    for name in OTHER_WEIGHTS:
        if spec.eval.model_args.get(name):
            raise SurgeryConfigError(
                f"sweep.eval.model_args: {name}= changes the merged weights, and each cell's "
                f"surgery is calibrated on them without it; drop {name}="
            )


def check_served(spec: SweepSpec, block: Mapping[str, Any]) -> None:
    """Every eval task must be served by a surgery task (``eval_tasks`` or ``eval.surgery_map``)."""
    if spec.eval.surgery_map:
        served = parse_surgery_map(spec.eval.surgery_map)
    else:
        served = {
            eval_task: task["name"]
            for task in block["tasks"]
            for eval_task in task.get("eval_tasks") or [task["name"]]
        }
    for task in spec.eval.tasks:
        if surgery_task_for(served, task) is None:
            raise SurgeryConfigError(
                f"sweep.eval.tasks: no surgery task serves {task!r}; list it in a surgery task's "
                "eval_tasks, or set eval.surgery_map (e.g. 'gsm8k:math;humaneval:code', or "
                f"'{task}:none' to score it without surgery)"
            )


def run_spec_file(
    spec_path: str | Path, *, output: str | Path | None = None, cache_dir: str | Path | None = None
) -> dict[str, Path]:
    """What ``mergekit-darts sweep`` does: load, run, write the results; returns the files.

    ``output`` overrides the spec's ``output:``; ``cache_dir`` its block's ``cache_dir``.
    """
    spec = load_spec(spec_path)
    folder = Path(output) if output else output_dir(spec, spec_path)
    records = run_sweep(spec, folder, CaptureStore(cache_dir) if cache_dir else None)
    return write_results(folder, records, spec)


def run_sweep(
    spec: SweepSpec, output: Path, store: CaptureStore | None = None
) -> list[dict[str, Any]]:
    """Run every unfinished cell (of every merge); returns all cell records, earlier or new.

    ``store`` (default: one on the block's ``cache_dir``) is shared by every cell and merge, so
    each target is captured once for the whole sweep.
    """
    from lm_eval.tasks import TaskManager

    merges = locate_merges(spec, output)
    planned = plan(spec)
    store = store if store is not None else CaptureStore(block_cache_dir(spec))
    output.mkdir(parents=True, exist_ok=True)
    task_manager = TaskManager(
        include_path=spec.eval.include_path, include_defaults=spec.eval.include_defaults
    )
    records = []
    progress = tqdm(total=len(planned) * len(merges), desc="sweep", unit="cell")
    for merge in merges:
        merged = make_merge(merge, progress.write) if merge.source else merge.folder
        records += run_merge_cells(
            spec, merge, merged, planned, output, store, task_manager, progress
        )
        store.forget(str(merged))  # its captures stay on disk; the targets' stay in memory
    progress.close()
    print(store.summary())
    return records


def run_merge_cells(
    spec: SweepSpec,
    merge: Merge,
    merged: Path,
    planned: Planned,
    output: Path,
    store: CaptureStore,
    task_manager: Any,
    progress: Any,
) -> list[dict[str, Any]]:
    """The cells of one merged model: every surgery first, then every evaluation.

    Two passes keep one full model in memory at a time: the captures (each model loaded once,
    through the store) and training happen before the one evaluation model is loaded, which then
    serves every cell with its modules swapped.
    """
    eval_key = spec.eval.model_dump()
    task_files = tasks_identity(spec.eval.tasks, task_manager)  # read once, at this merge's start
    records: list[dict[str, Any] | None] = []
    todo: list[tuple[int, Cell]] = []
    known: dict[str, Any] = {}  # identities read for this merge's cells
    for grid_settings, block in planned:
        settings = {MERGE: merge.name, **grid_settings} if merge.name else grid_settings
        cell = Cell(settings, block, output / CELLS / cell_id(settings), "")
        inputs = inputs_identity(merged, block, known)
        cell.key = fingerprint(str(merged), block, eval_key, inputs, task_files, *merge.fingerprint)
        done = load_cell(cell.folder)
        if done is not None and done.get("fingerprint") == cell.key:
            progress.write(f"{cell_id(settings)}: finished earlier, skipped")
            progress.update()
            records.append(done)
        else:
            todo.append((len(records), cell))
            records.append(None)
    model = EvalModel(merged, spec.eval)
    try:
        for _, cell in todo:
            progress.set_postfix_str(f"{cell_id(cell.settings)}: surgery")
            calibrate_cell(merged, cell, store)
        for index, cell in todo:
            name = cell_id(cell.settings)
            progress.set_postfix_str(f"{name}: evaluation")
            record = evaluate_cell(spec, cell, task_manager, model)
            scores = ", ".join(f"{t} {s:.1f}" for t, s in record["scores"].items())
            progress.write(f"{name}: {scores} ({sum(record['seconds'].values()):.0f}s)")
            progress.update()
            records[index] = record
    finally:
        model.close()
        for _, cell in todo:  # stopped before it was scored: never half a cell in its folder
            cell.discard()
    return [r for r in records if r is not None]
