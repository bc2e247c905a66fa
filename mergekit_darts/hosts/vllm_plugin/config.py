"""``model_type: "darts"`` for transformers' ``AutoConfig``, as vLLM reads it.

An exported ``config.json`` is the merged model's config with ``model_type: "darts"`` and a
``darts`` section naming the base ``model_type``, checked by the shipped file's ``darts_section``
(so a bad section fails here as it does under transformers). :class:`VllmDartsConfig` is registered
for ``"darts"``; its ``from_dict`` returns an instance of a subclass of the base config class
(built once per base class, e.g. ``DartsLlamaConfig(LlamaConfig)``), so vLLM sees every field of
the base config plus ``darts``. The subclass keeps ``model_type = "darts"``, so transformers' own
``AutoModelForCausalLM`` still refuses to load the folder as a plain model in this process.
Built classes resolve as attributes of this module, so configs pickle into vLLM's workers.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from mergekit_darts.correction.modeling_darts import ARCHITECTURE_PREFIX, MODEL_TYPE, darts_section


@functools.cache
def vllm_config_class(base: type[PretrainedConfig]) -> type[PretrainedConfig]:
    """``Darts<Base>``: the base config class under ``model_type = "darts"``."""
    name = ARCHITECTURE_PREFIX + base.__name__
    return type(
        name, (base,), {"model_type": MODEL_TYPE, "__module__": __name__, "__qualname__": name}
    )


class VllmDartsConfig(PretrainedConfig):
    """Registered for ``"darts"``; ``from_dict`` hands back the base config's Darts subclass."""

    model_type = MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> PretrainedConfig:
        base = CONFIG_MAPPING[darts_section(config_dict)["base_model_type"]]
        return vllm_config_class(base).from_dict(config_dict, **kwargs)


def __getattr__(name: str) -> type[PretrainedConfig]:
    """``Darts<Base>Config`` by name (how pickle finds a built class in another process)."""
    import transformers

    base = (
        getattr(transformers, name.removeprefix(ARCHITECTURE_PREFIX), None)
        if name.startswith(ARCHITECTURE_PREFIX)
        else None
    )
    if isinstance(base, type) and issubclass(base, PretrainedConfig):
        return vllm_config_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
