"""DARTS surgery for plain transformers: load an exported folder with ``trust_remote_code=True``.

Written by ``mergekit-darts export``. The folder holds a merged decoder's weights plus one small
float32 module that corrects the final hidden state ``h`` (the LM head's input) of each token at
absolute position ``p`` (0 = its sequence's first real token): ``h_hat = h - correction(h, p)``.
A routed export holds every task's module behind a gate that weighs them per token from ``h``
alone: ``h_hat = h - sum_k softmax(W h + b)_k correction_k(h, p)`` (no task id, no state carried
across calls). A module of kind ``none`` is the identity (no tensors).

The correction itself (modules, router, position rule, float32 step) is ``darts_correction.py``,
shipped next to this file: mergekit-darts' own ``correction/darts_correction.py``, copied verbatim, the code
its training, ``apply_surgery`` and vLLM plugin run too. This file adds the export format
(``config.json``'s ``darts`` section: ``export_config`` writes it, ``darts_section`` checks it),
the check of the weights the surgery belongs to, and the transformers classes:
``DartsConfig`` and ``DartsForCausalLM`` build, once per base class, a subclass of transformers'
own config and causal-LM classes (named in ``config.darts``) that adds the ``darts_surgery``
module and a forward pre-hook on the output embedding, so head bias, logit scaling and
softcapping after the head stay the base model's own. Nothing here copies model code. It imports
only torch, transformers, the standard library and its sibling (it must load where mergekit-darts
is not installed).
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .darts_correction import (
    MODULE_KINDS,
    ROUTED,
    SURGERY,
    RoutedSurgery,
    SurgeryModule,
    corrected_head_input,
    correction_module,
    enter_call,
    leave_call,
    positional_names,
    weights_fingerprint,
)

# ---- the export format ------------------------------------------------------------------------------

MODEL_TYPE = "darts"  # config.json's model_type: plain transformers refuses it without this file
FORMAT, VERSION = "darts-export", 1  # config.json's darts.format and darts.version
ARCHITECTURE_PREFIX = "Darts"  # config.json's architectures: Darts<base architecture>
TENSOR_PREFIX = (
    SURGERY + "."
)  # so the checkpoint's names of the surgery tensors are the attribute's
SURGERY_FILE = "darts_surgery.safetensors"  # the surgery tensors, listed in the weight index
AUTO_MAP = {
    "AutoConfig": "modeling_darts.DartsConfig",
    "AutoModelForCausalLM": "modeling_darts.DartsForCausalLM",
}
ROUTED_FIELDS = ("name", "module", "rank", "max_positions")  # each darts.routed.tasks entry
_SIZES = ("rank", "max_positions")
_HINT = "re-export it with `mergekit-darts export`"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def export_config(
    config: Mapping[str, Any],
    *,
    hidden_size: int,
    task: str | None = None,
    module: str | None = None,
    rank: int | None = None,
    max_positions: int | None = None,
    routed: Mapping[str, Any] | None = None,
    weights: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The exported ``config.json``: the merged model's ``config`` plus the checked ``darts`` section.

    One task: ``task``, ``module``, ``rank``, ``max_positions``. Routed (every task's module behind
    the gate ``softmax(W h + b)``): ``routed={"tasks": [{"name", "module", "rank",
    "max_positions"}, ...] in gate order, "background": bool}`` instead, and ``module`` "routed".
    ``weights`` (weight file name in the export -> :func:`weights_fingerprint`) lets the loaded
    folder prove its weights are still those the surgery was exported with.
    """
    out = dict(config)
    out["architectures"] = [ARCHITECTURE_PREFIX + config["architectures"][0]]
    out["model_type"] = MODEL_TYPE
    out["auto_map"] = dict(AUTO_MAP)
    if routed is not None:
        what: dict[str, Any] = {
            "module": ROUTED,
            "routed": {
                "tasks": [{k: dict(t)[k] for k in ROUTED_FIELDS} for t in routed["tasks"]],
                "background": routed["background"],
            },
        }
    else:
        what = {"task": task, "module": module, "rank": rank, "max_positions": max_positions}
    out["darts"] = {
        "format": FORMAT,
        "version": VERSION,
        "base_model_type": config["model_type"],
        "base_architecture": config["architectures"][0],
        **what,
        "hidden_size": hidden_size,
        "prefix": TENSOR_PREFIX,
        **({"weights": dict(sorted(weights.items()))} if weights else {}),
    }
    darts_section(out)
    return out


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def darts_section(config: Mapping[str, Any] | PretrainedConfig) -> dict[str, Any]:
    """The checked ``darts`` section of an exported config (its dict or a loaded config).

    Transformers (``DartsConfig.from_dict``) and the vLLM plugin both read a folder through this,
    so a bad section fails the same way, with one line, before any weight is read.
    """
    darts = config.get("darts") if isinstance(config, Mapping) else getattr(config, "darts", None)
    if not isinstance(darts, dict) or darts.get("format") != FORMAT:
        raise ValueError(f"config.json has model_type 'darts' but no {FORMAT!r} section: {_HINT}")
    if darts.get("version") != VERSION:
        raise ValueError(
            f"config.json's darts section has version {darts.get('version')!r}, this code reads "
            f"version {VERSION}: upgrade mergekit-darts or {_HINT}"
        )
    base = darts.get("base_model_type")
    if base not in CONFIG_MAPPING or base == MODEL_TYPE:
        raise ValueError(
            f"config.json's darts.base_model_type {base!r} is not a model type transformers "
            f"{transformers.__version__} knows: upgrade transformers or {_HINT}"
        )
    architecture = darts.get("base_architecture")
    if not isinstance(architecture, str) or not architecture:
        raise ValueError(f"config.json's darts section names no base_architecture: {_HINT}")
    if darts.get("module") == ROUTED:
        _check_routed(darts)
    else:
        if darts.get("module") not in MODULE_KINDS:
            raise ValueError(
                f"config.json's darts.module {darts.get('module')!r} is not one of "
                f"{(*MODULE_KINDS, ROUTED)}: {_HINT}"
            )
        if "routed" in darts:
            raise ValueError(
                f"config.json's darts section has a routed entry but darts.module "
                f"{darts['module']!r} (a routed export has module {ROUTED!r}): {_HINT}"
            )
        if not all(isinstance(darts.get(k), int) and darts[k] > 0 for k in _SIZES):
            raise ValueError(
                f"config.json's darts section needs positive integers {(*_SIZES, 'hidden_size')}: "
                f"{_HINT}"
            )
    if not (isinstance(darts.get("hidden_size"), int) and darts["hidden_size"] > 0):
        raise ValueError(
            f"config.json's darts section needs positive integers {(*_SIZES, 'hidden_size')}: "
            f"{_HINT}"
        )
    if darts.get("prefix") != TENSOR_PREFIX:
        raise ValueError(
            f"config.json's darts.prefix {darts.get('prefix')!r} is not the tensor name prefix "
            f"{TENSOR_PREFIX!r}: {_HINT}"
        )
    weights = darts.get("weights", {})  # absent in exports made before it was recorded
    if not isinstance(weights, dict) or not all(
        isinstance(name, str)
        and os.path.basename(name) == name
        and name not in ("", ".", "..")
        and isinstance(value, str)
        and _SHA256.fullmatch(value)
        for name, value in weights.items()
    ):
        raise ValueError(
            f"config.json's darts.weights must map plain weight file names to sha256 hex digests: "
            f"{_HINT}"
        )
    return darts


def _check_routed(darts: Mapping[str, Any]) -> None:
    """A routed section: ``routed`` = {tasks: [{name, module, rank, max_positions}, ...] (two or
    more, distinct names, gate order), background: bool}, and no single task's fields."""
    where = "config.json's darts.routed"
    single = sorted(k for k in ("task", "rank", "max_positions") if k in darts)
    if single:
        raise ValueError(
            f"config.json's darts section of a routed export has single-task field(s) "
            f"{', '.join(single)}: {_HINT}"
        )
    routed = darts.get("routed")
    if not isinstance(routed, dict) or sorted(routed) != ["background", "tasks"]:
        raise ValueError(f"{where} must be {{'tasks': [...], 'background': true|false}}: {_HINT}")
    if not isinstance(routed["background"], bool):
        raise ValueError(f"{where}.background must be true or false: {_HINT}")
    tasks = routed["tasks"]
    if not isinstance(tasks, list) or len(tasks) < 2:
        raise ValueError(f"{where}.tasks must list two or more tasks: {_HINT}")
    names = []
    for i, task in enumerate(tasks):
        if not isinstance(task, dict) or sorted(task) != sorted(ROUTED_FIELDS):
            raise ValueError(
                f"{where}.tasks[{i}] must have exactly the keys {ROUTED_FIELDS}: {_HINT}"
            )
        if not isinstance(task["name"], str) or not task["name"]:
            raise ValueError(f"{where}.tasks[{i}].name must be a non-empty string: {_HINT}")
        if task["module"] not in MODULE_KINDS:
            raise ValueError(
                f"{where}.tasks[{i}].module {task['module']!r} is not one of {MODULE_KINDS}: "
                f"{_HINT}"
            )
        if not all(_positive(task[k]) for k in _SIZES):
            raise ValueError(f"{where}.tasks[{i}] needs positive integers {_SIZES}: {_HINT}")
        names.append(task["name"])
    if len(set(names)) != len(names):
        raise ValueError(f"{where}.tasks names a task twice: {names}: {_HINT}")


# ---- the weights the surgery belongs to --------------------------------------------------------------
# A surgery module corrects the weights it was calibrated on, and no others. An export's weights are
# symlinks, hardlinks or copies of its merge's files, so a merge redone in place changes a linked
# export under it: the export records each weight file's fingerprint and refuses to load another.


def check_weights(folder: str | os.PathLike[str], darts: Mapping[str, Any]) -> None:
    """Refuse a local export folder whose weight files are not those it was exported with."""
    for name, expected in sorted(darts.get("weights", {}).items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ValueError(f"{path} is missing: this DARTS export lists it among its weights")
        if weights_fingerprint(path) == expected:
            continue
        if name == SURGERY_FILE:
            raise ValueError(
                f"{path} is not the surgery file this DARTS export was made with (replaced or "
                f"edited since, e.g. copied from another export): {_HINT}"
            )
        raise ValueError(
            f"{path} is not the weight file this DARTS export was made with (its merge was "
            "redone or changed since; a --link symlink or hardlink export follows its source), "
            "so its surgery belongs to other weights: re-run `mergekit-darts calibrate` on the "
            "merge, then `mergekit-darts export` again"
        )


# ---- the module a config describes ------------------------------------------------------------


def surgery_for(config: PretrainedConfig) -> SurgeryModule | RoutedSurgery:
    """The (zero) module a loaded config's ``darts`` section describes, checked against the model.

    Built with float32 tensors: transformers and vLLM build a model under its dtype as torch's
    default, and an offloaded tensor comes back from disk in the dtype it was built with.
    """
    darts = darts_section(config)
    hidden_size = getattr(config.get_text_config(), "hidden_size", None)
    if darts["hidden_size"] != hidden_size:
        raise ValueError(
            f"config.json's darts.hidden_size {darts['hidden_size']} does not match the model's "
            f"hidden_size {hidden_size}: {_HINT}"
        )
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        if darts["module"] == ROUTED:
            routed = darts["routed"]
            return RoutedSurgery.zeros(routed["tasks"], routed["background"], hidden_size)
        return correction_module(
            darts["module"], hidden_size, darts["rank"], darts["max_positions"]
        )
    finally:
        torch.set_default_dtype(default)


# ---- transformers classes ---------------------------------------------------------------------------


class _DartsConfigMixin:
    """Saves back as model_type ``darts`` with the ``auto_map`` that points at this file."""

    model_type = MODEL_TYPE
    _auto_class = "AutoConfig"  # save_pretrained copies this file next to config.json

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()  # type: ignore[misc]
        output["auto_map"] = {**(output.get("auto_map") or {}), **AUTO_MAP}
        if isinstance(output.get("darts"), dict):  # a saved model writes weight files of its own
            output["darts"] = {k: v for k, v in output["darts"].items() if k != "weights"}
        return output


@functools.cache
def darts_config_class(base_model_type: str) -> type:
    """The base model's own config class with model_type ``darts``."""
    base = CONFIG_MAPPING[base_model_type]
    # named DartsConfig: transformers writes auto_map entries and checks classes by __name__
    return type("DartsConfig", (_DartsConfigMixin, base), {"__module__": __name__})


class DartsConfig(PretrainedConfig):
    """What ``auto_map`` names: checks the ``darts`` section, builds the right ``darts_config_class``."""

    model_type = MODEL_TYPE

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        base_model_type = darts_section(config_dict)["base_model_type"]
        return darts_config_class(base_model_type).from_dict(config_dict, **kwargs)


_HOOKING = threading.Lock()  # one hook per head even when threads make their first calls at once


class _DartsModelMixin:
    """Adds ``darts_surgery`` and applies it to the LM head's input on every forward call.

    One forward pre-hook on the output embedding, a bound method of the model (so ``deepcopy``
    and pickling carry it to the copy), reads the positions of the call running *in its own
    thread*: threads that share the model never see each other's positions. The head is hooked
    on the first call (again if ``resize_token_embeddings`` replaced it); outside this model's
    forward (the head called directly) the hook leaves the input alone.
    """

    _auto_class = None  # auto_map and the file copy come with the config (see _DartsConfigMixin)
    _darts_forward_names: tuple[str, ...] = ()

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        super().__init__(config, *args, **kwargs)  # type: ignore[call-arg]
        setattr(self, SURGERY, surgery_for(config))

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, *args: Any, **kwargs: Any) -> Any:
        """transformers' load, refused when a local folder's weights are not the exported ones.

        (A Hub repository holds copies that no merge can change under it: nothing to check.)
        """
        folder = os.path.join(str(pretrained_model_name_or_path), kwargs.get("subfolder") or "")
        unchecked = os.path.isdir(folder)
        config = kwargs.get("config")
        if unchecked and isinstance(config, PretrainedConfig):  # before the load: none wasted
            check_weights(folder, darts_section(config))
            unchecked = False
        model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)  # type: ignore[misc]
        if unchecked:
            check_weights(folder, darts_section(model.config))
        return model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.update(zip(self._darts_forward_names, args, strict=False))
        self._darts_hook_head()
        try:
            enter_call(id(self), kwargs)
            return super().forward(**kwargs)  # type: ignore[misc]
        finally:
            leave_call(id(self))

    def _darts_hook_head(self) -> None:
        head = self.get_output_embeddings()  # type: ignore[attr-defined]
        hook = self._darts_correct_head_input
        if hook not in head._forward_pre_hooks.values():
            with _HOOKING:
                if hook not in head._forward_pre_hooks.values():
                    head.register_forward_pre_hook(hook)

    def _darts_correct_head_input(self, _head: nn.Module, args: tuple) -> tuple | None:
        """Replaces the head's input ``h`` by ``h_hat`` during this model's forward calls."""
        h_hat = corrected_head_input(id(self), getattr(self, SURGERY), args[0])
        return None if h_hat is None else (h_hat, *args[1:])

    def _adjust_missing_and_unexpected_keys(self, loading_info: Any) -> None:
        """Refuses a checkpoint whose surgery tensors are missing or do not fit the config.

        ``from_pretrained`` reports the keys it could not load to this method (transformers 5)
        before it logs its report: the surgery would otherwise be left uninitialised (NaN logits).
        """
        super()._adjust_missing_and_unexpected_keys(loading_info)  # type: ignore[misc]
        missing = {k for k in loading_info.missing_keys if k.startswith(TENSOR_PREFIX)}
        mismatched = {k for k in loading_info.mismatched_keys if k[0].startswith(TENSOR_PREFIX)}
        unexpected = {k for k in loading_info.unexpected_keys if k.startswith(TENSOR_PREFIX)}
        if missing or mismatched or unexpected:
            loading_info.missing_keys -= missing  # the one line below says it all
            loading_info.mismatched_keys -= mismatched
            loading_info.unexpected_keys -= unexpected
            found = sorted(unexpected | {k[0] for k in mismatched})
            raise ValueError(
                f"this DARTS export's {TENSOR_PREFIX}* tensors do not fit its config.json's "
                f"{getattr(self, SURGERY).kind} module (missing: {sorted(missing) or 'none'}; "
                f"unexpected or misshapen: {found or 'none'}): its {SURGERY_FILE} or weight "
                f"index is damaged; {_HINT}"
            )


@functools.cache
def darts_model_class(base_architecture: str, base_model_type: str) -> type:
    """transformers' own ``base_architecture`` class with the surgery added."""
    base = getattr(transformers, base_architecture, None)
    if not (isinstance(base, type) and issubclass(base, PreTrainedModel)):
        raise ValueError(
            f"this DARTS export needs transformers.{base_architecture}, which transformers "
            f"{transformers.__version__} does not have: upgrade transformers"
        )
    strict = set(getattr(base, "_keep_in_fp32_modules_strict", None) or ()) | {SURGERY}
    keep = set(getattr(base, "_keep_in_fp32_modules", None) or ()) | {SURGERY}
    model_class = type(
        ARCHITECTURE_PREFIX + base_architecture,
        (_DartsModelMixin, base),
        {
            "__module__": __name__,
            "config_class": darts_config_class(base_model_type),
            "_keep_in_fp32_modules": keep,
            "_keep_in_fp32_modules_strict": strict,
            # positional forward arguments are passed on by keyword, so positions can read them
            "_darts_forward_names": positional_names(base.forward),
        },
    )
    # what transformers' auto classes did for DartsForCausalLM, for the class actually built
    # (pipelines check the model's class against this mapping)
    transformers.AutoModelForCausalLM.register(model_class.config_class, model_class, exist_ok=True)
    return model_class


def _model_class(config: Any) -> type:
    darts = darts_section(config)
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
