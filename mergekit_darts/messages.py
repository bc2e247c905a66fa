"""One-line messages for schema errors, naming the key path the way the YAML spells it.

pydantic reports every problem with a location tuple; a user wants the first one, as
``surgery.tasks[0].calibration.max_length: must be > 0 (got 0)``, plus what is allowed there.
The block, the manifest and the sweep spec all go through :func:`describe_error`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

BOUNDS = {
    "greater_than": "> ",
    "greater_than_equal": ">= ",
    "less_than": "< ",
    "less_than_equal": "<= ",
}


def describe_error(err: ValidationError, root: type[BaseModel], root_key: str) -> str:
    """One line for the first error of validating ``root``, its key path starting at ``root_key``."""
    errors = err.errors()
    first = errors[0]
    loc = [p for p in first["loc"] if not (isinstance(p, str) and "[" in p)]  # drop union tags
    key = key_path(root_key, loc)
    kind, value = first["type"], first.get("input")
    if kind == "extra_forbidden":
        allowed = ", ".join(model_at(root, loc[:-1]).model_fields)
        text = f"{key}: unknown key; allowed here: {allowed}"
    elif kind == "missing":
        text = f"{key}: required key is missing"
    elif kind == "literal_error":
        choices = first["ctx"]["expected"].replace("'", "")
        text = f"{key}: {short(value)} is not allowed; choose one of {choices}"
    elif kind in BOUNDS:
        bound = BOUNDS[kind]
        text = f"{key}: must be {bound}{next(iter(first['ctx'].values()))} (got {short(value)})"
    elif kind == "too_short":
        text = f"{key}: must not be empty"
    elif kind == "value_error":  # our validators name the value themselves
        text = f"{key}: {first['msg'].removeprefix('Value error, ')}"
    else:
        text = f"{key}: {first['msg'].lower()} (got {short(value)})"
    more = len(errors) - 1
    return first_line(text + (f" (and {more} more problem{'s' * (more > 1)})" if more else ""))


def key_path(root_key: str, loc: Sequence[Any]) -> str:
    """``surgery`` + ``("tasks", 0, "loss")`` -> ``surgery.tasks[0].loss``."""
    key = root_key
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else f".{part}"
    return key


def model_at(root: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel]:
    """The schema class whose keys sit at ``loc`` below ``root`` (list indices skipped)."""
    model = root
    for part in loc:
        if not isinstance(part, int):
            model = _model_in(model.model_fields[part].annotation) or model
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model class inside an annotation such as ``list[TaskConfig] | None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if found := _model_in(arg):
            return found
    return None


def short(value: Any) -> str:
    """``repr(value)``, cut to 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def first_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines too) made one space."""
    return " ".join(text.split())


def exponent_form(value: float) -> str:
    """``value`` as the docs and YAML examples write a learning rate: ``1e-3``, ``2.5e-4``."""
    mantissa, _, exponent = f"{value:e}".partition("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
