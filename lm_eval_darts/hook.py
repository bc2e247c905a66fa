"""Registration of ``hf-darts`` with lm-eval's model registry.

lm-eval (in the versions pyproject.toml allows) reads no model entry points, so the stock
``lm_eval`` command learns about ``hf-darts`` from the startup hook (``_darts_startup``), which
calls :func:`install` right after ``lm_eval.models`` has registered the built-in models. The order
matters: ``get_model`` imports ``lm_eval.models`` only while the registry is empty, so registering
first would hide ``hf`` and every other built-in. Only a lazy ``"module:Class"`` placeholder is
registered; torch and HFLM load when someone asks for ``hf-darts``.
"""

from __future__ import annotations

import warnings
from types import ModuleType

MODEL_NAME = "hf-darts"
TARGET = "lm_eval_darts.model:DartsHFLM"


def _register_placeholder() -> None:
    from lm_eval.api.registry import model_registry

    # An entry point (newer lm-eval), the class itself or an earlier call may have put it there.
    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=TARGET)


def install(models_module: ModuleType) -> None:
    """Startup-hook entry, called with the freshly imported ``lm_eval.models``.

    A failure here must not take the stock ``lm_eval`` down with it, so it becomes a warning.
    """
    try:
        _register_placeholder()
    except Exception as err:  # any lm-eval API drift lands here
        warnings.warn(
            f"mergekit-darts could not register {MODEL_NAME} with {models_module.__name__} "
            f"({type(err).__name__}: {err}); use the lm-eval-darts command instead",
            RuntimeWarning,
            stacklevel=2,
        )


def register() -> None:
    """Make ``hf-darts`` available without the startup hook (``DARTS_NO_HOOK=1``, other installs)."""
    import lm_eval.models  # noqa: F401 - built-ins first, see the module docstring

    _register_placeholder()
