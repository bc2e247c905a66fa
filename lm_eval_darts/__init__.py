"""lm-eval integration of mergekit-darts: the ``hf-darts`` model class.

``lm_eval --model hf-darts --model_args pretrained=out/,surgery=math`` evaluates a merged checkpoint
with its surgery module. The class lives in :mod:`lm_eval_darts.model` and is imported lazily (it
pulls in torch and lm-eval's HF backend). The startup hook registers it with the stock ``lm_eval``;
without the hook (``DARTS_NO_HOOK=1``), call :func:`register` before ``simple_evaluate``.
"""

from lm_eval_darts.hook import register

__all__ = ["register"]
