"""mergekit-darts: decoder-aware representation surgery (DARTS) for merged LLMs.

Data flow: merge YAML -> mergekit merge -> capture hidden states (``capture``) -> train one
module per task (``train``) -> save into ``out/surgery`` (``artifacts``) -> apply at inference
(``apply``; lm-eval's ``hf-darts`` uses the same code).

The public names load lazily (PEP 562): the startup hook imports ``mergekit_darts.hook`` on
every ``mergekit-yaml`` start, and that must not pull in torch-heavy modules it does not need.
"""

from importlib import import_module
from typing import TYPE_CHECKING

_EXPORTS = {
    "SurgeryHandle": "apply",
    "apply_surgery": "apply",
    "load_surgery": "artifacts",
    "SurgeryModule": "core.modules",
    "build_module": "core.modules",
    "run_surgery": "integrations.post_merge",
}

__all__ = [
    "SurgeryHandle",
    "SurgeryModule",
    "apply_surgery",
    "build_module",
    "load_surgery",
    "run_surgery",
]

if TYPE_CHECKING:
    from mergekit_darts.apply import SurgeryHandle, apply_surgery
    from mergekit_darts.artifacts import load_surgery
    from mergekit_darts.core.modules import SurgeryModule, build_module
    from mergekit_darts.integrations.post_merge import run_surgery


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mergekit_darts' has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
