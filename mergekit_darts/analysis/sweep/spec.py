"""``sweep.yml``: which merged model(s), the base surgery block, the grid, how cells are scored.

The settings a grid may vary, and the type each value must have, come from the block's own
schema (:mod:`mergekit_darts.config`): every per-task override (``Candidate``), the block-wide
``cache_dtype`` and the calibration sizes. A setting added to the schema is sweepable at once,
and a grid value is checked exactly as the same value in a surgery block would be.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from mergekit_darts.config import (
    CalibrationConfig,
    Candidate,
    StrictBlock,
    SurgeryConfig,
    read_surgery_file,
    read_yaml,
)
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.messages import describe_error, key_path, model_at

ROOT = "sweep"  # the first part of every key path in a message
BLOCK_KEYS = ("cache_dtype",)  # set once on the block, not per task
CALIBRATION_KEYS = ("num_samples", "max_length", "continuation_tokens")  # set under calibration:


def _setting_type(field: FieldInfo) -> Any:
    """A schema field's type as a grid value: constraints kept, ``| None`` dropped.

    pydantic keeps the constraints of a plain ``PositiveInt`` field in ``metadata`` and those of
    an optional one inside the annotation; both come back as one ``Annotated`` type.
    """
    annotation = field.annotation
    if get_origin(annotation) in (Union, types.UnionType):
        (annotation,) = (arg for arg in get_args(annotation) if arg is not type(None))
    return Annotated[(annotation, *field.metadata)] if field.metadata else annotation


GRID_TYPES: dict[str, Any] = {
    key: _setting_type(field)
    for key, field in {
        **Candidate.model_fields,  # module, loss, rank, ..., loss_positions: a task's overrides
        **{key: SurgeryConfig.model_fields[key] for key in BLOCK_KEYS},
        **{key: CalibrationConfig.model_fields[key] for key in CALIBRATION_KEYS},
    }.items()
}
_GRID_ADAPTERS = {key: TypeAdapter(list[kind]) for key, kind in GRID_TYPES.items()}


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


class EvalSpec(StrictBlock):
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


class Compare(StrictBlock):
    a: str
    b: str
    unit: Literal["seed", "item"] = "seed"


class SweepSpec(StrictBlock):
    """The whole ``sweep.yml``: one merged model (``merged``) or a grid of merges (``merges``)."""

    merged: str | None = None
    merges: list[str] | None = Field(default=None, min_length=1)
    surgery: str | dict[str, Any]
    output: str | None = None
    grid: Grid
    baseline: bool = True
    eval: EvalSpec
    compare: Compare | None = None


def load_spec(path: str | Path) -> SweepSpec:
    """Parse and validate ``sweep.yml``; one-line errors naming the key path."""
    path = Path(path)
    data = read_yaml(path)
    if not isinstance(data, Mapping):
        raise SurgeryConfigError(f"{path}: expected a mapping with merged, surgery, grid, eval")
    try:
        spec = SweepSpec.model_validate(dict(data))
    except ValidationError as err:
        raise SurgeryConfigError(_describe(err)) from None
    if (spec.merged is None) == (spec.merges is None):
        raise SurgeryConfigError(
            "sweep: give `merged: PATH` (one merged model) or `merges: [merge YAML, ...]` (a merge "
            "grid), not both and not neither"
        )
    return spec


def _describe(err: ValidationError) -> str:
    """The block's one-line message, except where the sweep's own wording is older.

    A grid error names the setting and value index after ``sweep.grid`` (``_check_grid`` raises
    ``lr[1]: ...``); an unknown key lists what is ``allowed:``; a too short list says pydantic's
    words.
    """
    first = err.errors()[0]
    loc, kind = first["loc"], first["type"]
    key = key_path(ROOT, loc)
    if kind == "value_error" and tuple(loc) == ("grid",):
        return f"{key}.{first['msg'].removeprefix('Value error, ')}"
    if kind == "extra_forbidden":
        return (
            f"{key}: unknown key; allowed: {', '.join(model_at(SweepSpec, loc[:-1]).model_fields)}"
        )
    if kind == "too_short":
        return f"{key}: {first['msg'].lower()} (got {first.get('input')!r})"
    return describe_error(err, SweepSpec, ROOT)


def base_block(spec: SweepSpec) -> dict[str, Any]:
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
