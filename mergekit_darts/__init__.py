"""mergekit-darts: decoder-aware representation surgery (DARTS) for merged LLMs.

Data flow: merge YAML -> mergekit merge -> calibrate (capture hidden states, train one module per
task) -> save into ``out/surgery`` -> load and apply at inference (lm-eval's ``hf-darts``) or
export (transformers, vLLM). The subpackages read top-down; each imports only those above it:

- ``errors``, ``envflags``, ``messages``, ``overlap``: one error root, the boolean environment
  flags, one-line schema messages, the n-gram overlap with calibration prompts;
- ``correction``: the two files every export ships (``darts_correction.py``, the correction
  itself, and ``modeling_darts.py``, the export format; torch and transformers only, nothing of
  this package), the kinds' sizes, seeded training modules, losses, metrics and the LM head's
  real output path;
- ``task_map``: which module serves which lm-eval task;
- ``folder``: the ``surgery/`` format: manifest, artifacts, diagnostics, identity, atomic writes;
- ``apply``: the correction as hooks on a loaded model;
- ``config``: the ``surgery:`` block: schema, resolution, parsing, preflight checks;
- ``calibrate``: prompts -> captured hidden states (with a store) -> trained modules -> ``surgery/``;
- ``present``: the model card (merged folder and export), the terminal summary, the report and
  its plots;
- ``hosts``: mergekit (``run_merge``, ``mergekit-multi``, the recorded recipe), the post-merge
  step, lm-eval as a ``select`` metric, the export (``deploy``) and the vLLM plugin;
- ``analysis``: statistics and sweeps;
- ``cli``: one thin file per command, imported only when that command runs.

The demo (``python -m demo``) and the benchmarks live beside this package in the repository and
are not installed with it; nothing here imports them.

The public names load lazily (PEP 562): the startup hook imports
``mergekit_darts.hosts.mergekit.hook`` on every ``mergekit-yaml`` start, and that must not
pull in torch-heavy modules it does not need.
"""

from typing import TYPE_CHECKING

_EXPORTS = {
    "SurgeryHandle": "apply",
    "apply_surgery": "apply",
    "load_surgery": "folder.artifacts",
    "SurgeryModule": "correction.darts_correction",
    "build_module": "correction.modules",
    "run_surgery": "hosts.post_merge",
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
    from mergekit_darts.correction.darts_correction import SurgeryModule
    from mergekit_darts.correction.modules import build_module
    from mergekit_darts.folder.artifacts import load_surgery
    from mergekit_darts.hosts.post_merge import run_surgery


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mergekit_darts' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
