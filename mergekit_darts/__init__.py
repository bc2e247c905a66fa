"""mergekit-darts: decoder-aware representation surgery (DARTS) for merged LLMs.

Data flow: merge YAML -> mergekit merge -> calibrate (capture hidden states, train one module per
task) -> save into ``out/surgery`` -> load and apply at inference (lm-eval's ``hf-darts``) or
export (transformers, vLLM). The subpackages read top-down; each imports only those above it:

- ``errors``, ``fs``, ``manifest``, ``task_map``: one error root, atomic writes, the file names and
  typed manifest, which module serves which lm-eval task;
- ``core``: the modules, losses, metrics and the LM head's real output path (torch only);
  ``core/correction.py``, the correction itself, imports nothing of this package and ships
  inside every export;
- ``config``: the ``surgery:`` block: schema, resolution, parsing, preflight checks, messages;
- ``artifacts``, ``apply``: the ``surgery/`` folder written and read; the correction as hooks;
- ``calibrate``: prompts -> captured hidden states (with a store) -> trained modules -> ``surgery/``;
- ``integrations``: mergekit's ``run_merge`` and ``mergekit-multi``, the post-merge step, the
  recorded recipe, the model card;
- ``deploy``: export (``modeling_darts.py`` is shipped inside every export next to
  ``core/correction.py``, importing only torch, transformers and that file) and ``vllm_plugin``;
- ``analysis``: report, plots, statistics, sweeps;
- ``cli``: one thin file per command, imported only when that command runs.

The demo (``python -m demo``) and the benchmarks live beside this package in the repository and
are not installed with it; nothing here imports them.

The public names load lazily (PEP 562): the startup hook imports
``mergekit_darts.integrations.mergekit_hook`` on every ``mergekit-yaml`` start, and that must not
pull in torch-heavy modules it does not need.
"""

from typing import TYPE_CHECKING

_EXPORTS = {
    "SurgeryHandle": "apply",
    "apply_surgery": "apply",
    "load_surgery": "artifacts",
    "SurgeryModule": "core.correction",
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
    from mergekit_darts.core.correction import SurgeryModule
    from mergekit_darts.core.modules import build_module
    from mergekit_darts.integrations.post_merge import run_surgery


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mergekit_darts' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
