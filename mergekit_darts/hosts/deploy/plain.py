"""A plain export: a task's plain correction (``head``, ``norm``) folded into the merge's own
tensors, written as an ordinary checkpoint of the merge's architecture.

Nothing of this package is needed to serve it: no ``auto_map``, no Python files, no tensor the
architecture lacks, so stock transformers, vLLM, llama.cpp's GGUF converter and the engines built
on them load it as the merge. ``head`` rewrites the LM head as ``W (I - M)``; a tied head is
untied into a separate ``lm_head.weight`` (``tie_word_embeddings: false``, +V x H parameters).
``norm`` rewrites the final norm's weight so its scale is ``s`` times the merge's, and its bias
(LayerNorm, as Phi's) to ``s`` times the merge's, since ``s (g x + b) = (g s) x + b s`` (a tied head
stays tied). Neither kind has a shift: no bias is added to an LM head that lacks one, and a head
bias (Phi's) stays as it is, ``W (I - M) h + b``. Only the shards that hold a rewritten tensor are written anew; the rest are placed
as ``--link`` says.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save
from transformers import AutoConfig, AutoModelForCausalLM

from mergekit_darts.correction.darts_correction import (
    HeadSurgery,
    NormSurgery,
    NoSurgery,
    SurgeryModule,
)
from mergekit_darts.correction.spec import plain_kind_problem
from mergekit_darts.errors import ExportError

# where a decoder keeps the norm whose output is the LM head's input, by attribute of its base model
FINAL_NORMS = ("norm", "final_layernorm", "ln_f", "final_norm")


def check_plain_kind(kind: str, model_type: str | None, key: str) -> None:
    """Refuse a plain kind that the engines would lose on this architecture."""
    problem = plain_kind_problem(kind, model_type)
    if problem is not None:
        raise ExportError(f"{key}: {problem}")


@dataclass(frozen=True)
class Layout:
    """Which checkpoint tensors a plain correction rewrites, read off the model's own classes."""

    head: str  # the tensor the LM head computes with (the embedding's when tied)
    norm: str | None  # the final norm's weight
    norm_bias: str | None  # the final norm's bias (LayerNorm), if it has one
    norm_offset: float  # 1.0 where the norm scales by (1 + w) (Gemma), else 0.0
    tied: bool  # no separate head tensor in the checkpoint


def layout(out: Path, weight_map: Mapping[str, str]) -> Layout:
    """The head and final-norm tensors of the merge in ``out``, from a weightless instance."""
    config = AutoConfig.from_pretrained(out)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {id(m): n for n, m in model.named_modules()}
    head = names[id(model.get_output_embeddings())] + ".weight"
    tied = head not in weight_map
    if tied:
        head = names[id(model.get_input_embeddings())] + ".weight"
    base = model.base_model
    norm = next((getattr(base, a) for a in FINAL_NORMS if hasattr(base, a)), None)
    norm_name = None if norm is None else names[id(norm)] + ".weight"
    has_bias = norm is not None and getattr(norm, "bias", None) is not None
    bias_name = names[id(norm)] + ".bias" if has_bias else None
    if any(n is not None and n not in weight_map for n in (head, norm_name, bias_name)):
        raise ExportError(f"{out}: the LM head or final norm is not among its tensors by name")
    offset = 0.0 if norm is None else _offset(norm)
    return Layout(head, norm_name, bias_name, offset, tied)


def _offset(norm: torch.nn.Module) -> float:
    """1.0 when a zero weight leaves the norm's input scaled by one (it applies ``1 + w``); a
    bias (LayerNorm) is zeroed too, or it alone would pass for the offset."""
    probe = copy.deepcopy(norm).to_empty(device="cpu").float()
    with torch.no_grad():
        probe.weight.zero_()
        if getattr(probe, "bias", None) is not None:
            probe.bias.zero_()
        out = probe(torch.ones(1, 1, probe.weight.shape[0]))
    return 1.0 if bool(out.abs().sum() > 0) else 0.0


def folded_tensors(
    out: Path, weight_map: Mapping[str, str], module: SurgeryModule, where: Layout
) -> dict[str, torch.Tensor]:
    """The tensors, by checkpoint name, that carry ``module`` folded in (new names included);
    none for kind ``none`` (the merge as it is)."""
    if isinstance(module, NoSurgery):
        return {}
    if isinstance(module, HeadSurgery):
        head = _read(out / weight_map[where.head], where.head)
        return {"lm_head.weight" if where.tied else where.head: module.fold_head(head)}
    if isinstance(module, NormSurgery):
        if where.norm is None:
            raise ExportError(f"{out}: no final norm found to fold the norm correction into")
        weight = _read(out / weight_map[where.norm], where.norm)
        folded = {where.norm: module.fold_norm(weight, where.norm_offset)}
        if where.norm_bias is not None:  # a bias adds no offset: it scales by s alone
            bias = _read(out / weight_map[where.norm_bias], where.norm_bias)
            folded[where.norm_bias] = module.fold_norm(bias, 0.0)
        return folded
    raise ExportError(f"module {module.kind!r} is not plain: it exports with its own code")


def _read(file: Path, name: str) -> torch.Tensor:
    with safe_open(file, framework="pt") as handle:
        return handle.get_tensor(name)


def write_shards(
    out: Path,
    folder: Path,
    weight_map: Mapping[str, str],
    folded: Mapping[str, torch.Tensor],
    home: str,
) -> tuple[dict[str, str], set[str]]:
    """Write each shard that holds a folded tensor (a new tensor goes into ``home``'s shard) with
    those tensors in place; returns the new weight map and the shards written. The other shards
    are the caller's to place."""
    weight_map = dict(weight_map) | {
        name: weight_map.get(name, weight_map[home]) for name in folded
    }
    written = {weight_map[name] for name in folded}
    for shard in sorted(written):
        with safe_open(out / shard, framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        tensors |= {n: t.contiguous() for n, t in folded.items() if weight_map[n] == shard}
        (folder / shard).write_bytes(save(tensors, metadata={"format": "pt"}))
    return weight_map, written


def plain_config(config: Mapping[str, Any], where: Layout, kind: str) -> dict[str, Any]:
    """The merge's config.json, untied where the head was tied and now has its own tensor."""
    config = dict(config)
    if kind == HeadSurgery.kind and where.tied:
        config["tie_word_embeddings"] = False
    return config
