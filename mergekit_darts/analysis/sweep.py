"""Ablation sweeps: a grid of surgery settings on one merged model, each cell calibrated and scored.

The paper's ablations (Tables 5, 6, 9-14) vary one or two settings — module, loss, rank, steps,
learning rate, calibration size, seed — and score every variant on the same benchmarks. A sweep
does that from one YAML: each grid cell runs the real post-merge step (``run_surgery``) into its
own folder and is evaluated in-process with lm-eval through ``hf-darts``, with per-item scores
logged so that :mod:`mergekit_darts.stats` can pair them. Each finished cell is written to disk at
once and skipped on the next run, so a killed sweep loses only its unscored cells.

Calibrate once, train many: the cells share one :class:`~mergekit_darts.store.CaptureStore`, so
each model is loaded once for capture in the whole sweep (none with a warm ``cache_dir``), and one
``hf-darts`` model per merge is kept loaded across cells with its modules swapped between them.
With ``merges:`` (a merge grid, the paper's section 4.1 protocol) each merge YAML is merged with
mergekit first and the grid runs on every merge, the targets captured once for all of them.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import click
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, ValidationError
from tqdm.auto import tqdm

from mergekit_darts.analysis import stats
from mergekit_darts.calibrate.runtime import release
from mergekit_darts.calibrate.store import CaptureStore
from mergekit_darts.config import (
    CacheDtype,
    LossName,
    LossPositions,
    ModuleKind,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    parse_surgery,
    read_surgery_file,
    read_yaml,
    resolve_device,
)
from mergekit_darts.errors import SurgeryConfigError

CELLS = "cells"
MERGES = "merges"
MERGE = "merge"  # the settings key naming a cell's merge in a merge grid
MERGE_MARKER = ".darts-sweep-merge"  # sha256 of the merge YAML the folder was made from
RESULT = "result.json"
BASELINE = {"surgery": "none"}
CALIBRATION_KEYS = ("num_samples", "max_length", "continuation_tokens")


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


GRID_TYPES: dict[str, Any] = {
    "module": ModuleKind,
    "loss": LossName,
    "rank": PositiveInt,
    "max_positions": PositiveInt,
    "steps": PositiveInt,
    "lr": PositiveFloat,
    "batch_size": PositiveInt,
    "seed": NonNegativeInt,
    "loss_positions": LossPositions,
    "cache_dtype": CacheDtype,
    "num_samples": PositiveInt,
    "max_length": PositiveInt,
    "continuation_tokens": NonNegativeInt,
}
_GRID_ADAPTERS = {k: TypeAdapter(list[t]) for k, t in GRID_TYPES.items()}


def _check_grid(grid: Any) -> dict[str, list[Any]]:
    """Values to try per setting, in YAML order; a cell is one combination of them."""
    if not isinstance(grid, Mapping) or not grid:
        raise ValueError("expected a mapping of setting -> list of values, e.g. loss: [l1, ewl1]")
    checked = {}
    for key, values in grid.items():
        if key not in GRID_TYPES:
            raise ValueError(f"{key}: cannot be swept; choose from {', '.join(GRID_TYPES)}")
        if not isinstance(values, list) or not values:
            raise ValueError(f"{key}: expected a non-empty list of values, got {values!r}")
        try:
            checked[key] = _GRID_ADAPTERS[key].validate_python(values)
        except ValidationError as err:
            first = err.errors()[0]
            raise ValueError(
                f"{key}[{first['loc'][0]}]: {first['msg'].lower()} (got {first.get('input')!r})"
            ) from None
        if len(set(map(str, checked[key]))) != len(values):
            raise ValueError(f"{key}: a value is listed twice")
    return checked


Grid = Annotated[dict[str, list[Any]], BeforeValidator(_check_grid)]


class EvalSpec(_Block):
    """How each cell is scored: ``lm_eval.simple_evaluate`` arguments, model ``hf-darts``."""

    tasks: list[str] = Field(min_length=1)
    include_path: list[str] | str | None = None
    include_defaults: bool = True
    limit: float | None = None
    num_fewshot: int | None = None
    batch_size: int | str = 8
    device: str = "auto"
    model_args: dict[str, Any] = Field(default_factory=dict)
    surgery_map: str | None = None
    metric: str | dict[str, str] | None = None
    scale: float = 100.0
    gen_kwargs: dict[str, Any] | None = None
    apply_chat_template: bool = False
    confirm_run_unsafe_code: bool = False
    random_seed: int = 0


class Compare(_Block):
    a: str
    b: str
    unit: Literal["seed", "item"] = "seed"


class SweepSpec(_Block):
    """The whole ``sweep.yml``: one merged model (``merged``) or a grid of merges (``merges``)."""

    merged: str | None = None
    merges: list[str] | None = Field(default=None, min_length=1)
    surgery: str | dict[str, Any]
    output: str | None = None
    grid: Grid
    baseline: bool = True
    eval: EvalSpec
    compare: Compare | None = None


# --- the spec ------------------------------------------------------------------------------


def load_spec(path: str | Path) -> SweepSpec:
    """Parse and validate ``sweep.yml``; one-line errors naming the key path."""
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, Mapping):
        raise SurgeryConfigError(f"{path}: expected a mapping with merged, surgery, grid, eval")
    try:
        spec = SweepSpec.model_validate(dict(data))
    except ValidationError as err:
        first = err.errors()[0]
        key = "sweep" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        if first["type"] == "extra_forbidden":
            message = (
                f"unknown key; allowed: {', '.join(_model_at(first['loc'][:-1]).model_fields)}"
            )
        elif first["type"] == "missing":
            message = "required key is missing"
        elif first["type"] == "value_error":  # _check_grid: "<setting>[i]: <problem>"
            key, message = f"{key}.{first['msg'].removeprefix('Value error, ')}", ""
        else:
            message = f"{first['msg'].lower()} (got {first.get('input')!r})"
        raise SurgeryConfigError(f"{key}: {message}" if message else key) from None
    if (spec.merged is None) == (spec.merges is None):
        raise SurgeryConfigError(
            "sweep: give `merged: PATH` (one merged model) or `merges: [merge YAML, ...]` (a merge "
            "grid), not both and not neither"
        )
    return spec


def _model_at(loc: Sequence[Any]) -> type[BaseModel]:
    """The spec class whose keys sit at ``loc`` (for listing the allowed keys)."""
    model: type[BaseModel] = SweepSpec
    for part in loc:
        annotation = model.model_fields[part].annotation
        for candidate in (annotation, *getattr(annotation, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                model = candidate
    return model


def surgery_block(spec: SweepSpec) -> dict[str, Any]:
    """The base surgery block (inline, or read from a merge YAML or block YAML file).

    Its ``cache_dir`` is taken out: where captures are kept changes no result, so it is no part
    of a cell's block or fingerprint (:func:`cache_dir` reads it).
    """
    if isinstance(spec.surgery, str):
        block = copy.deepcopy(dict(read_surgery_file(spec.surgery)))
    else:
        block = copy.deepcopy(spec.surgery)
    block.pop("cache_dir", None)
    return block


def cache_dir(spec: SweepSpec) -> str | None:
    """The surgery block's ``cache_dir`` (``--cache-dir`` overrides it)."""
    if isinstance(spec.surgery, str):
        return read_surgery_file(spec.surgery).get("cache_dir")
    return spec.surgery.get("cache_dir")


def output_dir(spec: SweepSpec, spec_path: str | Path) -> Path:
    return Path(spec.output) if spec.output else Path("runs") / Path(spec_path).stem


def cells(grid: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, in YAML order (the last key varies fastest)."""
    return [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())]


def cell_id(settings: Mapping[str, Any]) -> str:
    """Folder-safe name of a cell, e.g. ``module-pos_corr__loss-ewl1__seed-0``."""
    return "__".join(f"{k}-{v}" for k, v in settings.items()) or "default"


def cell_block(block: Mapping[str, Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The surgery block of one cell: the grid's values set on every task (so they win)."""
    block = copy.deepcopy(dict(block))
    for key, value in settings.items():
        if key == "cache_dtype":
            block[key] = value
            continue
        for task in block.get("tasks") or []:
            if key in CALIBRATION_KEYS:
                task.setdefault("calibration", {})[key] = value
            else:
                task[key] = value
    return block


def fingerprint(*parts: Any) -> str:
    """sha256 of the JSON of what determines a cell's result: a changed spec reruns the cell."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


# --- one cell ------------------------------------------------------------------------------


def cell_model_dir(merged: Path, cell_dir: Path) -> Path:
    """A folder that looks like the merged checkpoint (symlinks) so ``run_surgery`` writes here.

    ``surgery/`` and the model card are not linked: the surgery and its card section of this
    cell must never land in the user's merged folder.
    """
    model = cell_dir / "model"
    model.mkdir(parents=True, exist_ok=True)
    for item in merged.iterdir():
        if item.name in ("surgery", "README.md") or item.name.startswith("."):
            continue
        link = model / item.name
        if not link.is_symlink():
            link.symlink_to(item.resolve(), target_is_directory=item.is_dir())
    return model


def calibrate(merged: Path, cell_dir: Path, block: Mapping[str, Any], store: CaptureStore) -> Path:
    """Run the real post-merge step for one cell; returns its ``surgery/`` folder.

    The cell's model folder links the merged files, so it has the merged model's identity and
    its captures come from ``store`` after the first cell: training is all a later cell costs.
    """
    from mergekit_darts.integrations.post_merge import run_surgery

    model = cell_model_dir(merged, cell_dir)
    run_surgery(model, block, overwrite=True, progress=False, write_card=False, store=store)
    return model / "surgery"


class EvalModel:
    """One ``hf-darts`` model of a merge, loaded at the first cell that needs it and kept.

    Cells differ only in their surgery modules, which ``DartsHFLM.set_surgery`` swaps; a finished
    sweep (every cell skipped) loads nothing.
    """

    def __init__(self, merged: Path, spec: EvalSpec) -> None:
        self.merged, self.spec = merged, spec
        self._lm: Any = None

    def get(self, surgery_path: Path | None) -> Any:
        """The model with ``surgery_path``'s modules routed as under ``auto`` (None: none)."""
        if self._lm is None:
            from lm_eval_darts.model import DartsHFLM

            self._lm = DartsHFLM.create_from_arg_obj(
                {"pretrained": str(self.merged), "surgery": "none", **self.spec.model_args},
                {"batch_size": self.spec.batch_size, "device": resolve_device(self.spec.device)},
            )
        if surgery_path is None:
            self._lm.set_surgery("none")
        else:
            self._lm.set_surgery("auto", str(surgery_path), self.spec.surgery_map)
        return self._lm

    def close(self) -> None:
        if self._lm is not None:
            self._lm = None
            release(resolve_device(self.spec.device))


def evaluate(
    model: EvalModel, surgery_path: Path | None, spec: EvalSpec, task_manager: Any
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` with ``hf-darts`` (``surgery=none`` for the baseline)."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=model.get(surgery_path),
        tasks=list(spec.tasks),
        num_fewshot=spec.num_fewshot,
        limit=spec.limit,
        log_samples=True,
        bootstrap_iters=0,
        gen_kwargs=spec.gen_kwargs,
        apply_chat_template=spec.apply_chat_template,
        confirm_run_unsafe_code=spec.confirm_run_unsafe_code,
        task_manager=task_manager,
        random_seed=spec.random_seed,
        numpy_random_seed=spec.random_seed,
        torch_random_seed=spec.random_seed,
        fewshot_random_seed=spec.random_seed,
    )


def _metric_key(task: str, row: Mapping[str, Any], spec: EvalSpec) -> str:
    """``metric,filter`` key of ``results[task]``: the configured metric or the task's first."""
    wanted = spec.metric.get(task) if isinstance(spec.metric, dict) else spec.metric
    keys = [k for k in row if "," in k and "_stderr" not in k.split(",")[0]]
    if wanted:
        hits = [k for k in keys if k == wanted or k.split(",")[0] == wanted]
        if not hits:
            raise SurgeryConfigError(
                f"eval.metric: task {task!r} reports no metric {wanted!r}; it has {', '.join(keys)}"
            )
        return hits[0]
    if not keys:
        raise SurgeryConfigError(f"eval.tasks: lm-eval returned no metric for task {task!r}")
    return keys[0]


def scores_of(results: Mapping[str, Any], spec: EvalSpec) -> dict[str, Any]:
    """Aggregate score, metric name and per-item scores of each task (scaled by ``eval.scale``)."""
    scores, metrics, items = {}, {}, {}
    for task in spec.tasks:
        if task not in results["results"]:
            raise SurgeryConfigError(f"eval.tasks: lm-eval returned no results for {task!r}")
        row = results["results"][task]
        key = _metric_key(task, row, spec)
        metric, _, filt = key.partition(",")
        scores[task] = spec.scale * float(row[key])
        metrics[task] = key
        items[task] = {
            str(s["doc_id"]): spec.scale * float(s[metric])
            for s in results.get("samples", {}).get(task, [])
            if s.get("filter", filt) == filt and metric in s
        }
    return {"scores": scores, "metric": metrics, "items": items}


def rho_of(surgery_path: Path, spec: EvalSpec) -> tuple[dict[str, float], dict[str, float | None]]:
    """rho_L1 per surgery task (manifest) and of the module serving each eval task."""
    from mergekit_darts.artifacts import read_manifest
    from mergekit_darts.routing import manifest_routes, parse_surgery_map, route

    manifest = read_manifest(surgery_path)
    rho = {name: float(entry["metrics"]["rho_l1"]) for name, entry in manifest["tasks"].items()}
    routes = parse_surgery_map(spec.surgery_map) if spec.surgery_map else manifest_routes(manifest)
    eval_rho = {}
    for task in spec.tasks:
        module = route(routes, task)
        eval_rho[task] = rho.get(module) if module else None
    return rho, eval_rho


def write_json(path: Path, data: Any) -> None:
    """Write-then-rename: a kill mid-write never leaves a half file that looks finished."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


@dataclass
class Cell:
    """One unfinished cell between the sweep's two passes."""

    settings: dict[str, Any]
    block: dict[str, Any] | None  # None: the baseline
    folder: Path
    key: str
    surgery_path: Path | None = None
    surgery_s: float = 0.0


def calibrate_cell(merged: Path, cell: Cell, store: CaptureStore) -> None:
    """The cell's surgery (none for the baseline), its captures lent by ``store``."""
    cell.folder.mkdir(parents=True, exist_ok=True)
    if cell.block is not None:
        start = time.perf_counter()
        cell.surgery_path = calibrate(merged, cell.folder, cell.block, store)
        cell.surgery_s = time.perf_counter() - start


def evaluate_cell(spec: SweepSpec, cell: Cell, task_manager: Any, model: EvalModel) -> dict:
    """Score a calibrated cell and write its ``result.json``."""
    start = time.perf_counter()
    results = evaluate(model, cell.surgery_path, spec.eval, task_manager)
    record: dict[str, Any] = {
        "cell": cell_id(cell.settings),
        "settings": dict(cell.settings),
        "fingerprint": cell.key,
        **scores_of(results, spec.eval),
        "rho_l1": {},
        "eval_rho": {},
        "seconds": {
            "surgery": round(cell.surgery_s, 3),
            "eval": round(time.perf_counter() - start, 3),
        },
    }
    if cell.surgery_path is not None:
        record["rho_l1"], record["eval_rho"] = rho_of(cell.surgery_path, spec.eval)
    write_json(cell.folder / RESULT, record)
    return record


# --- the sweep -----------------------------------------------------------------------------


def plan(spec: SweepSpec) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """(settings, surgery block or None for the baseline) of every cell, all validated up front."""
    base = surgery_block(spec)
    planned: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    if spec.baseline:
        planned.append((dict(BASELINE), None))
    for settings in cells(spec.grid):
        block = cell_block(base, settings)
        try:
            parse_surgery(block)
        except SurgeryConfigError as err:
            raise SurgeryConfigError(f"sweep cell {cell_id(settings)}: {err}") from None
        planned.append((settings, block))
    check_routes(spec, base)
    return planned


def check_routes(spec: SweepSpec, block: Mapping[str, Any]) -> None:
    """Every eval task must be served by a surgery task (``eval_tasks`` or ``eval.surgery_map``)."""
    from mergekit_darts.routing import parse_surgery_map, route

    if spec.eval.surgery_map:
        routes = parse_surgery_map(spec.eval.surgery_map)
    else:
        routes = {
            eval_task: task["name"]
            for task in block["tasks"]
            for eval_task in task.get("eval_tasks") or [task["name"]]
        }
    for task in spec.eval.tasks:
        if route(routes, task) is None:
            raise SurgeryConfigError(
                f"sweep.eval.tasks: no surgery task serves {task!r}; list it in a surgery task's "
                "eval_tasks, or set eval.surgery_map (e.g. 'gsm8k:math;humaneval:code', or "
                f"'{task}:none' to score it without surgery)"
            )


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
    store = store if store is not None else CaptureStore(cache_dir(spec))
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
    planned: list[tuple[dict[str, Any], dict[str, Any] | None]],
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
    records: list[dict[str, Any] | None] = []
    todo: list[tuple[int, Cell]] = []
    for grid_settings, block in planned:
        settings = {MERGE: merge.name, **grid_settings} if merge.name else grid_settings
        cell = Cell(settings, block, output / CELLS / cell_id(settings), "")
        cell.key = fingerprint(str(merged), block, eval_key, *merge.fingerprint)
        done = load_cell(cell.folder)
        if done is not None and done.get("fingerprint") == cell.key:
            progress.write(f"{cell_id(settings)}: finished earlier, skipped")
            progress.update()
            records.append(done)
        else:
            todo.append((len(records), cell))
            records.append(None)
    for _, cell in todo:
        progress.set_postfix_str(f"{cell_id(cell.settings)}: surgery")
        calibrate_cell(merged, cell, store)
    model = EvalModel(merged, spec.eval)
    try:
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
    return [r for r in records if r is not None]


# --- merge grids ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Merge:
    """One merged model of the sweep: given (``merged:``) or made from a YAML (``merges:``)."""

    name: str | None  # the YAML's stem; None for ``merged:``
    folder: Path
    source: Path | None = None  # the merge YAML
    config: Any = None  # its MergeConfiguration
    text: str = ""

    @property
    def fingerprint(self) -> tuple[str, ...]:
        """A changed merge YAML reruns the merge's cells (its folder keeps its name)."""
        return (hashlib.sha256(self.text.encode()).hexdigest(),) if self.source else ()


def locate_merges(spec: SweepSpec, output: Path) -> list[Merge]:
    """The merges to run, every YAML read and validated before anything is merged."""
    if spec.merged is not None:
        merged = Path(spec.merged).expanduser().resolve()
        if not (merged / "config.json").is_file():
            raise SurgeryConfigError(f"sweep.merged: no model (config.json) in {merged}")
        return [Merge(None, merged)]
    from mergekit.config import MergeConfiguration

    paths, seen = [], {}
    for index, entry in enumerate(spec.merges or []):
        key, path = f"sweep.merges[{index}]", Path(entry).expanduser()
        if path.stem in seen:
            raise SurgeryConfigError(
                f"{key}: {entry} and {seen[path.stem]} share the name {path.stem!r}, and each "
                f"merge is written to <output>/merges/<name>/; rename one"
            )
        seen[path.stem] = entry
        if not path.is_file():
            raise SurgeryConfigError(f"{key}: no merge YAML at {path.resolve()}")
        paths.append((key, entry, path))
    merges = []
    for key, entry, path in paths:
        text = path.read_text(encoding="utf-8")
        try:
            config = MergeConfiguration.model_validate(read_yaml(path))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise SurgeryConfigError(
                f"{key}: {entry} is not a mergekit config ({where}: {first['msg'].lower()})"
            ) from None
        except (RuntimeError, ValueError, TypeError) as err:  # mergekit's own validators
            raise SurgeryConfigError(
                f"{key}: {entry} is not a mergekit config ({' '.join(str(err).split())})"
            ) from None
        folder = (output / MERGES / path.stem).resolve()
        merges.append(Merge(path.stem, folder, path.resolve(), config, text))
    return merges


def make_merge(merge: Merge, log: Callable[[str], None] = print) -> Path:
    """Merge with mergekit's own (unwrapped) ``run_merge``, unless done from this very YAML.

    The YAML's own ``surgery:`` block is not run: every merge gets the sweep's grid. The merge
    is written under a temporary name and renamed, so a killed merge is redone, never used.
    """
    import inspect

    from mergekit import merge as mergekit_merge
    from mergekit.options import MergeOptions

    marker = merge.folder / MERGE_MARKER
    if marker.is_file() and marker.read_text() == merge.fingerprint[0]:
        log(f"merge {merge.name}: done earlier, kept")
        return merge.folder
    log(f"merge {merge.name}: merging {merge.source}")
    staging = merge.folder.with_name(f".{merge.folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    stock = inspect.unwrap(mergekit_merge.run_merge)
    try:
        stock(merge.config, str(staging), MergeOptions(quiet=True), config_source=merge.text)
        (staging / MERGE_MARKER).write_text(merge.fingerprint[0])
        shutil.rmtree(merge.folder, ignore_errors=True)
        os.replace(staging, merge.folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return merge.folder


def load_cell(cell_dir: Path) -> dict[str, Any] | None:
    path = cell_dir / RESULT
    return json.loads(path.read_text()) if path.is_file() else None


# --- tables --------------------------------------------------------------------------------


def _mean_std(values: Sequence[float], digits: int = 1) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def is_baseline(settings: Mapping[str, Any]) -> bool:
    return settings.get("surgery") == BASELINE["surgery"]


def varied_axes(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """Settings that take more than one value over the surgery cells, seed excluded.

    In a merge grid ``merge`` always comes first, even when one merge is listed.
    """
    surgery = [r for r in records if not is_baseline(r["settings"])]
    keys = list(dict.fromkeys(k for r in surgery for k in r["settings"]))
    axes = [
        k
        for k in keys
        if k not in (stats.SEED, MERGE) and len({str(r["settings"].get(k)) for r in surgery}) > 1
    ]
    return [MERGE, *axes] if any(MERGE in r["settings"] for r in records) else axes


def config_rows(records: Sequence[Mapping[str, Any]], tasks: Sequence[str]) -> list[dict]:
    """One row per configuration (seeds pooled): the shape of the paper's ablation tables.

    In a merge grid a configuration is a (merge, method) pair, the baseline one per merge, and
    ``best`` marks the merge with the highest mean average score for each method (section 4.1).
    """
    axes = varied_axes(records)
    groups: dict[tuple, list[Mapping[str, Any]]] = {}
    for r in records:
        settings = r["settings"]
        if is_baseline(settings):
            label = (*([settings[MERGE]] if MERGE in settings else []), "none")
        else:
            label = tuple(str(settings.get(a)) for a in axes)
        groups.setdefault(label, []).append(r)
    rows = []
    for label, members in groups.items():
        settings = members[0]["settings"]
        rhos = [statistics.fmean(m["rho_l1"].values()) for m in members if m.get("rho_l1")]
        if is_baseline(settings):
            config = {k: v for k, v in settings.items() if k in (MERGE, "surgery")}
        else:
            config = dict(zip(axes, label, strict=True))
        rows.append(
            {
                "config": config,
                "seeds": [m["settings"].get(stats.SEED) for m in members],
                "scores": {t: [m["scores"][t] for m in members] for t in tasks},
                "avg": [stats.average(m, tasks) for m in members],
                "rho_l1": rhos,
            }
        )
    if MERGE in axes:
        best: dict[str, tuple[float, dict]] = {}
        for row in rows:
            method = method_label(row["config"])
            mean = statistics.fmean(row["avg"])
            if method not in best or mean > best[method][0]:
                best[method] = (mean, row)
        for row in rows:
            row["best"] = best[method_label(row["config"])][1] is row
    return rows


def method_label(config: Mapping[str, Any]) -> str:
    """A configuration without its merge: what the best merge is chosen for."""
    return ",".join(f"{k}={v}" for k, v in config.items() if k != MERGE) or "default"


def results_markdown(records: Sequence[Mapping[str, Any]], tasks: Sequence[str]) -> str:
    """Configurations table (Tables 5, 6, 9-13 shape) and per-cell table (Table 14 shape).

    A merge grid's table has a merge column, a baseline row per merge, and ★ on the best merge
    of each method by average score; a second table lists those best merges.
    """
    axes = varied_axes(records)
    grid = MERGE in axes
    methods = [a for a in axes if a != MERGE]
    header = [*([MERGE] if grid else []), *(methods or ["config"]), *tasks, "Avg.", "ρ_L1 (%)"]
    rows, best = [], []
    all_rows = config_rows(records, tasks)
    for row in all_rows:
        config = row["config"]
        merge = [f"{config[MERGE]}{' ★' if row['best'] else ''}"] if grid else []
        if is_baseline(config):
            label = ["none (no surgery)"] + ["—"] * (max(len(methods), 1) - 1)
        else:
            label = [config[a] for a in methods] or ["default"]
        rho = _mean_std([100 * x for x in row["rho_l1"]]) if row["rho_l1"] else "—"
        avg = _mean_std(row["avg"])
        rows.append([*merge, *label, *(_mean_std(row["scores"][t]) for t in tasks), avg, rho])
        if grid and row["best"]:
            method = "none (no surgery)" if is_baseline(config) else method_label(config)
            best.append([method, config[MERGE], avg])
    n_seeds = max((len(r["seeds"]) for r in all_rows), default=1)
    parts = [
        "# Sweep results\n",
        f"Mean{' ± std over seeds' if n_seeds > 1 else ''}; ρ_L1 averaged over surgery tasks."
        + (" ★: the best merge of each method by Avg. (paper section 4.1).\n" if grid else "\n"),
        stats.table(header, rows),
    ]
    if grid:
        parts += ["\n## Best merge per method\n", stats.table(["method", MERGE, "Avg."], best)]
    parts += [
        "\n## Every cell\n",
        stats.table(
            ["cell", *tasks, "Avg.", "ρ_L1 (%)"],
            [
                [
                    r["cell"],
                    *(f"{r['scores'][t]:.1f}" for t in tasks),
                    f"{stats.average(r, tasks):.1f}",
                    f"{100 * statistics.fmean(r['rho_l1'].values()):.1f}" if r["rho_l1"] else "—",
                ]
                for r in records
            ],
        ),
    ]
    surgery = [r for r in records if not is_baseline(r["settings"])]
    correlations = stats.rho_correlations(surgery, tasks)
    if correlations:
        parts += ["\n## ρ_L1 vs. task score over cells (Table 3)\n"]
        parts += [stats.correlation_table(correlations)]
    return "\n".join(parts) + "\n"


def results_csv(records: Sequence[Mapping[str, Any]], tasks: Sequence[str]) -> str:
    """One line per cell: settings, scores, average, mean rho_L1 (easy to load in pandas)."""
    import csv
    import io

    keys = list(dict.fromkeys(k for r in records for k in r["settings"]))
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["cell", *keys, *tasks, "avg", "rho_l1"])
    for r in records:
        rho = statistics.fmean(r["rho_l1"].values()) if r["rho_l1"] else math.nan
        writer.writerow(
            [
                r["cell"],
                *(r["settings"].get(k, "") for k in keys),
                *(r["scores"][t] for t in tasks),
                stats.average(r, tasks),
                rho,
            ]
        )
    return buffer.getvalue()


def write_results(
    output: Path, records: Sequence[Mapping[str, Any]], spec: SweepSpec
) -> dict[str, Path]:
    """``results.{md,csv,json}``, the rho-vs-score scatter, and ``stats.md`` when asked."""
    from mergekit_darts.analysis.plots import plot_rho_vs_score

    tasks = list(spec.eval.tasks)
    data = {"tasks": tasks, "axes": varied_axes(records), "cells": list(records)}
    if MERGE in data["axes"]:
        rows = config_rows(records, tasks)
        data["configs"] = rows
        data["best_merge"] = {
            method_label(r["config"]): r["config"][MERGE] for r in rows if r.get("best")
        }
    write_json(output / "results.json", data)
    written = {"json": output / "results.json"}
    (output / "results.md").write_text(results_markdown(records, tasks))
    (output / "results.csv").write_text(results_csv(records, tasks))
    written |= {"markdown": output / "results.md", "csv": output / "results.csv"}
    points = {
        t: [(r["eval_rho"][t], r["scores"][t]) for r in records if r["eval_rho"].get(t) is not None]
        for t in tasks
    }
    if any(points.values()):
        written["scatter"] = plot_rho_vs_score(
            {t: p for t, p in points.items() if p}, output / "rho_vs_score.png"
        )
    if spec.compare is not None:
        markdown, comparison = stats.compare_report(
            data,
            stats.parse_selector(spec.compare.a),
            stats.parse_selector(spec.compare.b),
            spec.compare.unit,
        )
        (output / "stats.md").write_text(markdown + "\n")
        write_json(output / "stats.json", comparison)
        written["stats"] = output / "stats.md"
    return written


@click.command("sweep")
@click.argument("spec_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--output", type=click.Path(path_type=Path), help="Overrides `output:` of the YAML.")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Capture store on disk (overrides the surgery block's cache_dir): a second sweep loads "
    "no target.",
)
def sweep_command(spec_path: Path, output: Path | None, cache_dir: Path | None) -> None:
    """Run an ablation grid of surgery settings on a merged model, or on a grid of merges.

    Finished cells are kept in OUTPUT/cells/<cell>/result.json and skipped when run again; a
    merge grid's merges are written to OUTPUT/merges/<yaml stem>/.
    """
    spec = load_spec(spec_path)
    output = output or output_dir(spec, spec_path)
    records = run_sweep(spec, output, CaptureStore(cache_dir) if cache_dir else None)
    written = write_results(output, records, spec)
    click.echo((output / "results.md").read_text())
    click.echo("wrote " + ", ".join(str(p) for p in written.values()))
