"""mergekit-darts: decoder-aware representation surgery (DARTS) for merged LLMs.

Data flow: merge YAML -> mergekit merge -> capture hidden states (``capture``) -> train one
module per task (``train``) -> save into ``out/surgery`` (``artifacts``) -> apply at inference
(``apply``; lm-eval's ``hf-darts`` uses the same code).
"""

from .apply import SurgeryHandle, apply_surgery
from .artifacts import load_surgery
from .modules import SurgeryModule, build_module
from .pipeline import run_surgery

__all__ = [
    "SurgeryHandle",
    "SurgeryModule",
    "apply_surgery",
    "build_module",
    "load_surgery",
    "run_surgery",
]
