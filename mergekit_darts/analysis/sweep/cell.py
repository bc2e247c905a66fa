"""One cell of the grid: its settings, id, block and fingerprint; its surgery, score and record.

A cell's surgery is the real post-merge step (``run_surgery``) into the cell's own folder; its
score is ``lm_eval.simple_evaluate`` through ``hf-darts`` with per-item scores logged, so that
:mod:`mergekit_darts.analysis.stats` can pair cells. The finished record is ``result.json`` in
the cell's folder. A cell is written in a staging folder (its model links, surgery and record)
and renamed into place once scored, replacing what an earlier run left there: a killed sweep
never leaves a cell that looks finished, and a rerun cell is what a first run would write.
"""

from __future__ import annotations

import copy
import glob
import hashlib
import itertools
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergekit_darts.analysis.sweep.spec import BLOCK_KEYS, CALIBRATION_KEYS, EvalSpec, SweepSpec
from mergekit_darts.calibrate.runtime import release
from mergekit_darts.calibrate.store import CaptureStore
from mergekit_darts.config import resolve_device
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.folder import fs
from mergekit_darts.folder.identity import weights_identity
from mergekit_darts.folder.manifest import SURGERY_DIR

RESULT = "result.json"
MERGE = "merge"  # the settings key naming a cell's merge in a merge grid
BASELINE = {"surgery": "none"}  # the settings of the cell without surgery


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
        if key in BLOCK_KEYS:
            block[key] = value
            continue
        for task in block.get("tasks") or []:
            if key in CALIBRATION_KEYS:
                task.setdefault("calibration", {})[key] = value
            else:
                task[key] = value
    return block


def fingerprint(*parts: Any) -> str:
    """sha256 of the JSON of what determines a cell's result: a changed part reruns the cell.

    The sweep passes the merged folder's path, the cell's block, the eval settings, the
    :func:`inputs_identity` of the merged weights, the targets and the calibration files, the
    :func:`tasks_identity` of the eval tasks' configs and data files, and the merge YAML.
    """
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def inputs_identity(
    merged: Path, block: Mapping[str, Any] | None, known: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What a cell's numbers depend on besides its settings, by content: the merged weights and
    each task's target weights and calibration file.

    A path names a folder, not what is in it: a merge redone into ``merged:`` (or a target
    fine-tuned again, or a calibration file edited) must rerun the cells, never skip them with
    the old numbers. ``known`` (path -> identity) spares re-reading what another cell read.
    """
    known = {} if known is None else known

    def of(path: str | Path, read: Any) -> Any:
        key = str(path)
        if key not in known:
            known[key] = read(Path(path).expanduser())
        return known[key]

    identity: dict[str, Any] = {"merged": of(merged, weights_identity)}
    for task in (block or {}).get("tasks") or []:
        calibration = (task.get("calibration") or {}).get("path")
        identity[task["name"]] = {
            "target": of(task["target"], _target_identity),
            "calibration": of(calibration, _file_sha256) if calibration else None,
        }
    return identity


def tasks_identity(tasks: Sequence[str], task_manager: Any) -> dict[str, Any]:
    """What lm-eval reads for the eval tasks, by content: the config of each task, group and tag
    member (its YAML with every YAML it includes) and the local files it names: ``dataset_path``
    and the files, folders or globs in ``dataset_kwargs`` (``data_files``, ``data_dir``; relative
    to the working directory, as lm-eval reads them) and ``!function`` modules.

    Task names say nothing of what the files hold: an edited task YAML or data file must rerun
    the cells, never skip them with the old scores. A Hub dataset is named, not read.
    """
    index = task_manager.task_index
    found: dict[str, Any] = {}

    def visit(name: str) -> None:
        if name in found:
            return
        entry = index.get(name)
        if entry is None:  # a YAML path, or a name lm-eval itself will refuse
            config = _yaml_config(Path(name))
            members: list[str] = []
        else:
            config, members = entry.cfg, sorted(entry.tags) if entry.cfg is None else []
        found[name] = {"config": config, "files": _named_files(config or {})}
        for child in members + _group_members(config or {}):
            if child in index:
                visit(child)

    for task in tasks:
        visit(task)
    return found


def _yaml_config(path: Path) -> dict[str, Any] | None:
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=False) if path.is_file() else None


def _group_members(config: Mapping[str, Any]) -> list[str]:
    """Names of the tasks and groups a group config lists (inline configs: their own members)."""
    if "group" not in config:
        return []
    listed = config.get("task") or []
    members = []
    for item in listed if isinstance(listed, list) else [listed]:
        if isinstance(item, str):
            members.append(item)
        elif isinstance(item, Mapping):
            if isinstance(item.get("task"), str):
                members.append(item["task"])
            members += _group_members(item)
    return members


def _named_files(config: Mapping[str, Any]) -> dict[str, str | None]:
    """Local path -> sha256 of each file a task config names (None: named, not there)."""
    named = [config.get("dataset_path"), config.get("dataset_kwargs")]
    functions = [  # ``!function utils.process_docs`` reads as "<yaml folder>/utils.process_docs"
        str(Path(s).with_suffix(".py"))
        for s in _strings(config)
        if Path(s).is_absolute() and Path(s).suffix and Path(s).with_suffix(".py").is_file()
    ]
    files: dict[str, str | None] = {}
    for text in [*_strings(named), *functions]:
        path = Path(text).expanduser()
        if path.is_dir():
            for item in sorted(p for p in path.rglob("*") if p.is_file()):
                files[str(item)] = _file_sha256(item)
        elif path.is_file():
            files[text] = _file_sha256(path)
        elif any(c in text for c in "*?["):
            for item in sorted(glob.glob(text, recursive=True)):
                files[item] = _file_sha256(Path(item))
    return files


def _strings(value: Any) -> list[str]:
    """Every string in a nested config value, in order."""
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, Mapping):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list | tuple):
        return [s for item in value for s in _strings(item)]
    return []


def _target_identity(path: Path) -> str | None:
    return weights_identity(path) if path.is_dir() else f"hub:{path}"


def _file_sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def is_baseline(settings: Mapping[str, Any]) -> bool:
    return settings.get("surgery") == BASELINE["surgery"]


# --- surgery -------------------------------------------------------------------------------


def cell_model_dir(merged: Path, cell_dir: Path) -> Path:
    """A new folder in ``cell_dir`` that looks like the merged checkpoint (symlinks) so
    ``run_surgery`` writes here.

    ``surgery/`` and the model card are not linked: the surgery and its card section of this
    cell must never land in the user's merged folder (nor its recipe: ``run_surgery`` replaces
    that link with a file recording the cell's block).
    """
    model = cell_dir / "model"
    model.mkdir()
    for item in merged.iterdir():
        if item.name in (SURGERY_DIR, "README.md") or item.name.startswith("."):
            continue
        (model / item.name).symlink_to(item.resolve(), target_is_directory=item.is_dir())
    return model


def cell_surgery(
    merged: Path, cell_dir: Path, block: Mapping[str, Any], store: CaptureStore
) -> Path:
    """Run the real post-merge step for one cell; returns its ``surgery/`` folder.

    The cell's model folder links the merged files, so it has the merged model's identity and
    its captures come from ``store`` after the first cell: training is all a later cell costs.
    """
    from mergekit_darts.hosts.post_merge import run_surgery

    model = cell_model_dir(merged, cell_dir)
    run_surgery(model, block, overwrite=True, progress=False, write_card=False, store=store)
    return model / SURGERY_DIR


# --- evaluation ----------------------------------------------------------------------------


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
            from lm_eval.api.registry import get_model  # hf-darts, by its entry point

            self._lm = get_model("hf-darts").create_from_arg_obj(
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


def score_surgery(
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
    from mergekit_darts.folder.artifacts import read_manifest
    from mergekit_darts.task_map import manifest_task_map, parse_surgery_map, surgery_task_for

    manifest = read_manifest(surgery_path)
    rho = {name: float(entry.metrics["rho_l1"]) for name, entry in manifest.tasks.items()}
    served = (
        parse_surgery_map(spec.surgery_map) if spec.surgery_map else manifest_task_map(manifest)
    )
    eval_rho = {}
    for task in spec.tasks:
        module = surgery_task_for(served, task)
        eval_rho[task] = rho.get(module) if module else None
    return rho, eval_rho


# --- the cell and its record ---------------------------------------------------------------


def write_json(path: Path, data: Any) -> None:
    """Write-then-rename: a kill mid-write never leaves a half file that looks finished."""
    fs.write_text(path, json.dumps(data, indent=2) + "\n")


def load_cell(cell_dir: Path) -> dict[str, Any] | None:
    """The record of a finished cell, or None."""
    path = cell_dir / RESULT
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass
class Cell:
    """One unfinished cell between the sweep's two passes."""

    settings: dict[str, Any]
    block: dict[str, Any] | None  # None: the baseline
    folder: Path
    key: str
    staging: Path | None = None  # where the cell is written until it is scored
    surgery_path: Path | None = None
    surgery_s: float = 0.0

    def discard(self) -> None:
        """Drop a cell that was not scored: what an earlier run left in ``folder`` stays."""
        if self.staging is not None:
            fs.discard(self.staging)
            self.staging = None


def calibrate_cell(merged: Path, cell: Cell, store: CaptureStore) -> None:
    """The cell's surgery (none for the baseline) in a new staging folder, its captures lent by
    ``store``."""
    cell.staging = fs.new_staging(cell.folder)
    if cell.block is not None:
        start = time.perf_counter()
        cell.surgery_path = cell_surgery(merged, cell.staging, cell.block, store)
        cell.surgery_s = time.perf_counter() - start


def evaluate_cell(spec: SweepSpec, cell: Cell, task_manager: Any, model: EvalModel) -> dict:
    """Score a calibrated cell, write its ``result.json`` and rename the cell into place."""
    start = time.perf_counter()
    results = score_surgery(model, cell.surgery_path, spec.eval, task_manager)
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
    if cell.staging is None:  # a caller's slip, not a user's
        raise RuntimeError(f"sweep cell {record['cell']} was scored before calibrate_cell")
    write_json(cell.staging / RESULT, record)
    fs.swap_into_place(cell.staging, cell.folder)
    cell.staging = None
    return record
