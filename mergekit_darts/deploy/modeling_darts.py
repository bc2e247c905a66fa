"""DARTS surgery for plain transformers: load an exported folder with ``trust_remote_code=True``.

Written by ``mergekit-darts export``. The folder holds a merged decoder's weights plus one small
float32 module that corrects the final hidden state ``h`` (the LM head's input) of each token at
absolute position ``p`` (0 = its sequence's first real token): ``h_hat = h - correction(h, p)``.

Nothing here copies model code: ``DartsConfig`` and ``DartsForCausalLM`` build, once per base
class, a subclass of transformers' own config and causal-LM classes (named in ``config.darts``)
that adds the ``darts_surgery`` module and a forward pre-hook on the output embedding, so head
bias, logit scaling and softcapping after the head stay the base model's own.

This file imports only torch, transformers and the standard library (it must load where
mergekit-darts is not installed).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import transformers
from torch import nn
from torch.nn import functional as F
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

try:  # transformers >= 5.2x: the function the models themselves slice with
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # older 5.x: an int (0 = all) or an index tensor on the sequence dimension

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: Any) -> torch.Tensor:
        if isinstance(logits_to_keep, int):
            return hidden_states[:, slice(-logits_to_keep, None), :]
        return hidden_states[:, logits_to_keep, :]


AUTO_MAP = {
    "AutoConfig": "modeling_darts.DartsConfig",
    "AutoModelForCausalLM": "modeling_darts.DartsForCausalLM",
}
MODULE_KINDS = ("standard", "pos_corr", "add", "parallel")


# ---- the correction --------------------------------------------------------------------------------
# The math and the position rules below re-state mergekit_darts.modules and mergekit_darts.apply:
# this file cannot import mergekit-darts. Its tests check both give the same logits.


class _Matrix(nn.Module):
    """A bare ``weight`` (not ``nn.Linear``, so transformers' weight init never touches it)."""

    def __init__(self, rows: int, columns: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, columns, dtype=torch.float32))


class DartsSurgery(nn.Module):
    """The surgery module; parameter names match mergekit-darts' ``SurgeryModule`` state dicts.

    It stays float32 whatever the model's dtype: ``_apply`` (behind ``.to``, ``.half``,
    ``.bfloat16``, ``.cuda``) moves it between devices but never changes its dtype.
    """

    def __init__(self, kind: str, hidden_size: int, rank: int, max_positions: int):
        super().__init__()
        if kind not in MODULE_KINDS:
            raise ValueError(f"unknown DARTS module {kind!r}; expected one of {MODULE_KINDS}")
        self.kind, self.max_positions = kind, max_positions
        self.down, self.up = _Matrix(rank, hidden_size), _Matrix(hidden_size, rank)
        if kind == "pos_corr":
            self.position_bias = nn.Parameter(
                torch.zeros(max_positions, hidden_size, dtype=torch.float32)
            )
        if kind in ("add", "parallel"):
            self.position_embedding = nn.Parameter(
                torch.zeros(max_positions, hidden_size, dtype=torch.float32)
            )
        if kind == "parallel":
            self.position_down = _Matrix(rank, hidden_size)
            self.position_up = _Matrix(hidden_size, rank)

    def _apply(self, fn: Any, recurse: bool = True) -> DartsSurgery:
        def same_dtype(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return t.to(moved.device) if moved.dtype != t.dtype else moved

        return super()._apply(same_dtype, recurse)

    def extra_repr(self) -> str:
        return f"kind={self.kind}, max_positions={self.max_positions}"

    def _content(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.relu(F.linear(h, self.down.weight)), self.up.weight)

    def _rows(self, table: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if positions is None:
            raise ValueError(f"the {self.kind!r} DARTS module needs token positions")
        inside = (positions >= 0) & (positions < self.max_positions)
        rows = table[positions.clamp(0, self.max_positions - 1)]
        return rows * inside.unsqueeze(-1).to(rows.dtype)

    def correction(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "standard":
            return self._content(h)
        if self.kind == "pos_corr":
            return self._content(h) + self._rows(self.position_bias, positions)
        e = self._rows(self.position_embedding, positions)
        if self.kind == "add":
            return self._content(h + e)
        position = F.linear(
            torch.relu(F.linear(e, self.position_down.weight)), self.position_up.weight
        )
        return self._content(h) + position

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Corrected ``h``, computed in float32 and returned in ``h``'s dtype."""
        h32 = h.to(torch.float32)
        return (h32 - self.correction(h32, positions)).to(h.dtype)


def token_positions(
    reference: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache: Any,
) -> torch.Tensor:
    """Absolute position [B, T] of each new token; -1 marks padding.

    A 2-D mask covers past + new tokens, so its running count is each real token's place in its
    own sequence whatever the padding side; without one, the model's ``position_ids``, else the
    cache length + ``arange(T)``.
    """
    batch, width = reference.shape[:2]
    device = reference.device
    if attention_mask is not None and attention_mask.dim() == 2:
        real = attention_mask[:, -width:].to(device) != 0
        pos = attention_mask.to(device=device, dtype=torch.long).cumsum(-1)[:, -width:] - 1
        return pos.masked_fill(~real, -1)
    if position_ids is not None and position_ids.dim() == 2:
        return position_ids.to(device=device, dtype=torch.long).expand(batch, width)
    seen = getattr(cache, "get_seq_length", None)
    past = int(seen()) if callable(seen) else 0
    return torch.arange(past, past + width, device=device).expand(batch, width)


def _correct_head_input(
    surgery: DartsSurgery, positions: torch.Tensor | None, logits_to_keep: Any
) -> Any:
    """A forward pre-hook for the output embedding: replaces its input ``h`` by ``h_hat``."""

    def hook(_head: nn.Module, args: tuple) -> tuple:
        h = args[0]
        where = surgery.down.weight.device
        kept = None
        if positions is not None:
            kept = slice_logits_to_keep(positions.unsqueeze(-1), logits_to_keep).squeeze(-1)
            if kept.shape != h.shape[:-1]:
                raise RuntimeError(
                    f"DARTS: {tuple(kept.shape)} token positions for an LM-head input of shape "
                    f"{tuple(h.shape)}; this model slices its hidden states in a way not supported"
                )
            kept = kept.to(where)
        with torch.autocast(h.device.type, enabled=False):  # float32 even under autocast
            return (surgery(h.to(where), kept).to(h.device), *args[1:])

    return hook


# ---- transformers classes ---------------------------------------------------------------------------


class _DartsConfigMixin:
    """Saves back as model_type ``darts`` with the ``auto_map`` that points at this file."""

    model_type = "darts"
    _auto_class = "AutoConfig"  # save_pretrained copies this file next to config.json

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()  # type: ignore[misc]
        output["auto_map"] = {**(output.get("auto_map") or {}), **AUTO_MAP}
        return output


@functools.cache
def darts_config_class(base_model_type: str) -> type:
    """The base model's own config class with model_type ``darts``."""
    if base_model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"this DARTS export needs transformers' {base_model_type!r} model type, which "
            f"transformers {transformers.__version__} does not have: upgrade transformers"
        )
    base = CONFIG_MAPPING[base_model_type]
    # named DartsConfig: transformers writes auto_map entries and checks classes by __name__
    return type("DartsConfig", (_DartsConfigMixin, base), {"__module__": __name__})


class DartsConfig(PretrainedConfig):
    """What ``auto_map`` names: reads ``config.json`` and builds the right ``darts_config_class``."""

    model_type = "darts"

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        darts = config_dict.get("darts")
        if not isinstance(darts, dict) or "base_model_type" not in darts:
            raise ValueError(
                "config.json has model_type 'darts' but no 'darts' entry naming the base model: "
                "re-export the folder with mergekit-darts export"
            )
        return darts_config_class(darts["base_model_type"]).from_dict(config_dict, **kwargs)


class _DartsModelMixin:
    """Adds ``darts_surgery`` and applies it to the LM head's input on every forward call."""

    _auto_class = None  # auto_map and the file copy come with the config (see _DartsConfigMixin)
    _darts_forward_names: tuple[str, ...] = ()

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)  # type: ignore[call-arg]
        darts = config.darts
        self.darts_surgery = DartsSurgery(
            darts["module"],
            int(darts["hidden_size"]),
            int(darts["rank"]),
            int(darts["max_positions"]),
        )

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.update(zip(self._darts_forward_names, args, strict=False))
        reference = kwargs.get("input_ids")
        if reference is None:
            reference = kwargs.get("inputs_embeds")
        positions = None
        if reference is not None:
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            positions = token_positions(
                reference, kwargs.get("attention_mask"), kwargs.get("position_ids"), cache
            )
        head = self.get_output_embeddings()  # type: ignore[attr-defined]
        hook = head.register_forward_pre_hook(
            _correct_head_input(self.darts_surgery, positions, kwargs.get("logits_to_keep", 0))
        )
        try:
            return super().forward(**kwargs)  # type: ignore[misc]
        finally:
            hook.remove()


@functools.cache
def darts_model_class(base_architecture: str, base_model_type: str) -> type:
    """transformers' own ``base_architecture`` class with the surgery added."""
    base = getattr(transformers, base_architecture, None)
    if not (isinstance(base, type) and issubclass(base, PreTrainedModel)):
        raise ValueError(
            f"this DARTS export needs transformers.{base_architecture}, which transformers "
            f"{transformers.__version__} does not have: upgrade transformers"
        )
    strict = set(getattr(base, "_keep_in_fp32_modules_strict", None) or ()) | {"darts_surgery"}
    keep = set(getattr(base, "_keep_in_fp32_modules", None) or ()) | {"darts_surgery"}
    parameters = list(inspect.signature(base.forward).parameters.values())[1:]  # without self
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    model_class = type(
        f"Darts{base_architecture}",
        (_DartsModelMixin, base),
        {
            "__module__": __name__,
            "config_class": darts_config_class(base_model_type),
            "_keep_in_fp32_modules": keep,
            "_keep_in_fp32_modules_strict": strict,
            # positional forward arguments are passed on by keyword, so positions can read them
            "_darts_forward_names": tuple(p.name for p in parameters if p.kind in kinds),
        },
    )
    # what transformers' auto classes did for DartsForCausalLM, for the class actually built
    # (pipelines check the model's class against this mapping)
    transformers.AutoModelForCausalLM.register(model_class.config_class, model_class, exist_ok=True)
    return model_class


def _model_class(config: Any) -> type:
    darts = config.darts
    return darts_model_class(darts["base_architecture"], darts["base_model_type"])


class DartsForCausalLM(PreTrainedModel):
    """What ``auto_map`` names: dispatches to ``darts_model_class`` of the exported base class."""

    config_class = DartsConfig

    def __new__(cls, config: Any, *args: Any, **kwargs: Any) -> Any:
        return _model_class(config)(config, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.pop("config", None)
        if not isinstance(config, PretrainedConfig):
            config, kwargs = DartsConfig.from_pretrained(
                config or pretrained_model_name_or_path, return_unused_kwargs=True, **kwargs
            )
        return _model_class(config).from_pretrained(
            pretrained_model_name_or_path, *args, config=config, **kwargs
        )

    @classmethod
    def _from_config(cls, config: Any, **kwargs: Any) -> Any:
        return _model_class(config)._from_config(config, **kwargs)
