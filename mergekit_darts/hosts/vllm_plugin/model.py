"""``Darts<Arch>``: vLLM's own model class for ``<Arch>`` with the surgery on its output.

vLLM hands each token's absolute position in its own sequence to the model's ``forward``
(whatever the batching: continuous batching, chunked prefill, prefix caching), and ``forward``
returns the final hidden states that ``compute_logits`` feeds to the LM head. So the subclass
corrects exactly those: ``h - correction(h, p)`` in float32, cast back, with the module the
exported folder describes, built by the shipped ``modeling_darts.py`` from
:mod:`mergekit_darts.correction.darts_correction` (``SurgeryModule``, or for a routed export
``RoutedSurgery``: every task's module behind the per-token gate), the classes training and
``apply_surgery`` run. Each token is corrected from its own hidden state and position only, so
nothing is carried across decoding steps; a ``none`` module is the identity and has no tensors.
No model code is copied: one generic subclass per base class, built on first use by the module
``__getattr__`` that vLLM's lazy ``"module:Class"`` registrations (and pickle) resolve through.

Architectures vLLM serves only through its Transformers backend (Phi, GPT-NeoX, OLMo2,
Starcoder2, ...) get the same subclass of that backend's class, which runs transformers' own model
built by ``AutoModel.from_config(hf_config)`` and returns its final hidden states just the same;
:class:`_TransformersBackendMixin` only tells transformers which model the ``Darts<Base>Config``
stands for (see its docstring).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from vllm import ModelRegistry
from vllm.sequence import IntermediateTensors

from mergekit_darts.correction.darts_correction import Correction, StateMismatch, load_state
from mergekit_darts.correction.modeling_darts import (
    ARCHITECTURE_PREFIX,
    SURGERY,
    TENSOR_PREFIX,
    check_weights,
    darts_section,
    surgery_for,
)
from mergekit_darts.errors import SurgeryFormatError, UnsupportedModelError

TRANSFORMERS_BACKEND = "vllm.model_executor.models.transformers.base"  # defines its class `Base`


class _DartsMixin(nn.Module):
    """Put before vLLM's class in the bases: adds ``darts_surgery`` and wraps forward/load_weights."""

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        config = vllm_config.model_config.hf_config
        folder = vllm_config.model_config.model
        if os.path.isdir(folder):  # as transformers' load does: the files are the exported ones
            check_weights(folder, darts_section(config))
        # on vLLM's load device; float32 whatever the model's dtype
        module = surgery_for(config)
        self.add_module(SURGERY, module.requires_grad_(False).eval())

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if positions.dim() != 1:
            raise UnsupportedModelError(
                f"DARTS surgery needs one absolute position per token, got positions of shape "
                f"{tuple(positions.shape)} (multi-axis rotary positions are not supported)"
            )
        out = super().forward(input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs)
        surgery = getattr(self, SURGERY)
        if isinstance(out, IntermediateTensors):  # not the last pipeline stage: nothing to correct
            return out
        if isinstance(out, tuple):  # (hidden states, auxiliary hidden states for speculation)
            return (surgery(out[0], positions), *out[1:])
        return surgery(out, positions)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str] | None:
        surgery: dict[str, torch.Tensor] = {}

        def base_weights() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith(TENSOR_PREFIX):
                    surgery[name.removeprefix(TENSOR_PREFIX)] = tensor
                else:
                    yield name, tensor

        loaded = super().load_weights(base_weights())
        names = self._load_surgery(surgery)
        return None if loaded is None else set(loaded) | names

    def _load_surgery(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        module: Correction = getattr(self, SURGERY)
        try:
            load_state(module, tensors)
        except StateMismatch as err:
            raise SurgeryFormatError(
                f"the checkpoint's {TENSOR_PREFIX}* tensors {err.found} do not match the {module.kind} "
                f"module its config.json describes {err.expected}: re-export with "
                "`mergekit-darts export`"
            ) from None
        return {f"{SURGERY}.{name}" for name in tensors}


class _TransformersBackendMixin(nn.Module):
    """For vLLM's Transformers backend: let it build the base model from a ``Darts<Base>Config``.

    The backend builds transformers' own model with ``AutoModel.from_config(hf_config)``, which
    knows ``PhiConfig`` but not its ``DartsPhiConfig`` subclass, and maps checkpoint names with
    the renamings transformers keeps per architecture name (GPT-NeoX's ``embed_out`` ->
    ``lm_head``), which it looks up under the config's ``DartsGPTNeoXForCausalLM``. Both are
    registered here, in the process that builds the model, through transformers' own registries:
    the config class -> the base's model class, ``Darts<Arch>`` -> ``<Arch>``'s renamings.
    """

    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any):
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        config = vllm_config.model_config.hf_config
        darts = darts_section(config)
        base_model = MODEL_MAPPING[CONFIG_MAPPING[darts["base_model_type"]]]
        MODEL_MAPPING.register(type(config), base_model, exist_ok=True)
        renamings = get_checkpoint_conversion_mapping(darts["base_architecture"])
        if renamings:
            name = ARCHITECTURE_PREFIX + darts["base_architecture"]
            register_checkpoint_conversion_mapping(name, renamings, overwrite=True)
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)


@functools.cache
def vllm_model_class(arch: str) -> type[nn.Module]:
    """``Darts<arch>``: a subclass of the class vLLM registers for ``arch``."""
    if arch not in ModelRegistry.get_supported_archs():
        raise UnsupportedModelError(f"vLLM has no model class for architecture {arch!r}")
    base = ModelRegistry.models[arch].load_model_cls()
    if not callable(getattr(base, "compute_logits", None)):
        raise UnsupportedModelError(
            f"{arch} is not a text-generating model in vLLM (no compute_logits): DARTS corrects "
            "the hidden states in front of an LM head"
        )
    mixins: tuple[type, ...] = (_DartsMixin,)
    backend = sys.modules.get(TRANSFORMERS_BACKEND)  # loaded with `base` if `base` is one of its
    if backend is not None and issubclass(base, backend.Base):
        mixins += (_TransformersBackendMixin,)
    name = ARCHITECTURE_PREFIX + arch
    return type(name, (*mixins, base), {"__module__": __name__, "__qualname__": name})


def __getattr__(name: str) -> type[nn.Module]:
    if name.startswith(ARCHITECTURE_PREFIX) and len(name) > len(ARCHITECTURE_PREFIX):
        return vllm_model_class(name.removeprefix(ARCHITECTURE_PREFIX))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
