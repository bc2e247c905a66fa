"""One surgery module described once: its kind and sizes, and their defaults.

The surgery block's defaults (``config.schema``), each manifest entry (``manifest.TaskEntry``),
the export's ``darts`` section (``hosts.deploy.export``) and
:func:`mergekit_darts.correction.modules.build_module` all read these. (The exported folder checks its section by hand in ``modeling_darts.py``, which
must load without pydantic.)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StrictInt

from mergekit_darts.correction.darts_correction import MODULE_KINDS

ModuleKind = Literal[MODULE_KINDS]
PositiveInt = Annotated[StrictInt, Field(gt=0)]

DEFAULT_MODULE: ModuleKind = "pos_corr"  # DARTS (paper section 3.4)
DEFAULT_RANK = 16  # the bottleneck width (paper section 4.3)
DEFAULT_MAX_POSITIONS = 512  # rows of a position table


# llama.cpp's converter writes no separate output tensor for these (their GGUFs always tie), so the
# head kind's untied LM head would be lost there; norm keeps its correction in a tensor they keep
HEAD_DROPPED = ("gemma", "gemma2")


def plain_kind_problem(kind: str, model_type: str | None) -> str | None:
    """Why ``kind`` cannot ship as plain weights of ``model_type``, with the fix; None if it can."""
    if kind == "head" and model_type in HEAD_DROPPED:
        return (
            f"module head unties the LM head, which llama.cpp's converter drops for {model_type} "
            "(its GGUFs always tie): use module: norm for plain weights there"
        )
    return None


class ModuleSpec(BaseModel):
    """What builds one module: ``module`` (its kind), ``rank`` and ``max_positions``."""

    module: ModuleKind
    rank: PositiveInt
    max_positions: PositiveInt

    def module_fields(self) -> dict[str, Any]:
        """``{"module", "rank", "max_positions"}`` (a subclass, e.g. a manifest entry, holds
        more), as the export's ``darts`` section holds them."""
        return {name: getattr(self, name) for name in ModuleSpec.model_fields}
