"""``model_type: "darts"`` for transformers' ``AutoConfig``, as vLLM reads it.

An exported ``config.json`` is the merged model's config with ``model_type: "darts"`` and a
``darts`` section naming the base ``model_type``. :class:`DartsConfig` is registered for
``"darts"``; its ``from_dict`` returns an instance of a subclass of the base config class (built
once per base class, e.g. ``DartsLlamaConfig(LlamaConfig)``), so vLLM sees every field of the base
config plus ``darts``. The subclass keeps ``model_type = "darts"``, so transformers' own
``AutoModelForCausalLM`` still refuses to load the folder as a plain model in this process.
Built classes resolve as attributes of this module, so configs pickle into vLLM's workers.
"""

from __future__ import annotations

import functools
from typing import Any

from transformers import PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from mergekit_darts.core.modules import MODULE_KINDS
from mergekit_darts.deploy.export import FORMAT, VERSION

MODEL_TYPE = "darts"
_INTS = ("rank", "max_positions", "hidden_size")


def darts_section(config_dict: dict[str, Any]) -> dict[str, Any]:
    """The checked ``darts`` section of an exported config, or a one-line error."""
    darts = config_dict.get("darts")
    hint = "re-export it with `mergekit-darts export`"
    if not isinstance(darts, dict) or darts.get("format") != FORMAT:
        raise ValueError(f"config.json has model_type 'darts' but no {FORMAT!r} section: {hint}")
    if darts.get("version") != VERSION:
        raise ValueError(
            f"config.json's darts section has version {darts.get('version')!r}, this mergekit-darts "
            f"reads version {VERSION}: upgrade mergekit-darts or {hint}"
        )
    base = darts.get("base_model_type")
    if base not in CONFIG_MAPPING or base == MODEL_TYPE:
        raise ValueError(
            f"config.json's darts.base_model_type {base!r} is not a model type this transformers "
            f"knows: upgrade transformers or {hint}"
        )
    if darts.get("module") not in MODULE_KINDS:
        raise ValueError(
            f"config.json's darts.module {darts.get('module')!r} is not one of {MODULE_KINDS}: {hint}"
        )
    if not all(isinstance(darts.get(k), int) and darts[k] > 0 for k in _INTS):
        raise ValueError(f"config.json's darts section needs positive integers {_INTS}: {hint}")
    if not isinstance(darts.get("prefix"), str) or not darts["prefix"]:
        raise ValueError(f"config.json's darts section has no tensor name prefix: {hint}")
    return darts


@functools.cache
def darts_config_class(base: type[PretrainedConfig]) -> type[PretrainedConfig]:
    """``Darts<Base>``: the base config class under ``model_type = "darts"``."""
    name = f"Darts{base.__name__}"
    return type(
        name, (base,), {"model_type": MODEL_TYPE, "__module__": __name__, "__qualname__": name}
    )


class DartsConfig(PretrainedConfig):
    """Registered for ``"darts"``; ``from_dict`` hands back the base config's Darts subclass."""

    model_type = MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> PretrainedConfig:
        base = CONFIG_MAPPING[darts_section(config_dict)["base_model_type"]]
        return darts_config_class(base).from_dict(config_dict, **kwargs)


def __getattr__(name: str) -> type[PretrainedConfig]:
    """``Darts<Base>Config`` by name (how pickle finds a built class in another process)."""
    import transformers

    base = (
        getattr(transformers, name.removeprefix("Darts"), None)
        if name.startswith("Darts")
        else None
    )
    if isinstance(base, type) and issubclass(base, PretrainedConfig):
        return darts_config_class(base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
