"""vLLM plugin: serve a ``mergekit-darts export`` folder with its surgery, in vLLM's own model code.

vLLM calls :func:`register` (entry point group ``vllm.general_plugins``) in every process it starts.
It teaches transformers' ``AutoConfig`` the export's ``model_type: "darts"`` (:mod:`.config`) and
vLLM's model registry one ``Darts<Arch>`` architecture per architecture vLLM knows, each a lazy
``"module:Class"`` string that :mod:`.model` resolves into a subclass of vLLM's class for ``<Arch>``.
Importing this package imports nothing: vLLM, torch and transformers load only when vLLM calls
:func:`register`, and a model class only when vLLM loads a ``Darts<Arch>`` model. The export
format (model type, architecture prefix, the ``darts`` section's check) is the shipped
``mergekit_darts/correction/modeling_darts.py``'s, so vLLM and transformers read a folder alike.
"""

from __future__ import annotations

MODEL_MODULE = f"{__name__}.model"


def register() -> None:
    """Register the ``darts`` config type and the ``Darts<Arch>`` architectures (idempotent)."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from mergekit_darts.correction.modeling_darts import ARCHITECTURE_PREFIX
    from mergekit_darts.hosts.vllm_plugin.config import VllmDartsConfig

    AutoConfig.register(VllmDartsConfig.model_type, VllmDartsConfig, exist_ok=True)
    for arch in sorted(ModelRegistry.get_supported_archs()):
        if not arch.startswith(ARCHITECTURE_PREFIX):
            name = ARCHITECTURE_PREFIX + arch
            ModelRegistry.register_model(name, f"{MODEL_MODULE}:{name}")
