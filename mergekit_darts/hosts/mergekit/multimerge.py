"""Make ``mergekit-multi`` honour a ``surgery:`` block in any of its stages.

``mergekit-multi`` merges each YAML document (stage) with ``run_merge`` but passes no
``config_source``, so the raw block never reaches :mod:`mergekit_darts.hosts.mergekit.hook`. The startup hook
therefore wraps the command's callback when ``mergekit.scripts.multimerge`` is imported: it reads
the stages itself, checks every block before the first merge, lets mergekit run every stage, then
runs each stage's surgery on that stage's output folder. It also turns a bare relative
``--intermediate-dir`` (``-I inter``) into ``./inter``: mergekit's model card would otherwise take
``inter/<stage>`` for a Hugging Face Hub id and query the Hub for it.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger("mergekit_darts")


@dataclass(frozen=True)
class _Stage:
    name: str | None  # None: the unnamed final stage written to --out-path
    out_path: str
    block: Mapping[str, Any]


def install(multimerge: ModuleType) -> None:
    """Wrap the ``mergekit-multi`` click callback (once)."""
    command = multimerge.main
    original = command.callback
    if getattr(original, "__darts_hook__", False):
        return

    @functools.wraps(original)
    def callback(**kwargs: Any) -> Any:
        kwargs["intermediate_dir"] = local_dir(kwargs["intermediate_dir"])
        with open(kwargs["config_file"], encoding="utf-8") as file:
            text = file.read()
        stages = _stages(text, kwargs)
        if not stages:
            return original(**kwargs)
        prepared = _prepare(multimerge, text, stages, kwargs)
        result = original(**kwargs)
        _finish(prepared, kwargs)
        return result

    callback.__darts_hook__ = True  # type: ignore[attr-defined]
    command.callback = callback


def local_dir(path: str) -> str:
    """``inter`` -> ``./inter``: a path mergekit's ``is_hf`` cannot mistake for a Hub repo."""
    if not path or os.path.isabs(path) or path.startswith((".", "~")) or os.sep in path:
        return path
    return os.path.join(".", path)


def _stages(text: str, kwargs: dict[str, Any]) -> list[_Stage]:
    """The stages whose document carries a ``surgery:`` block, with their output folders."""
    import yaml

    from mergekit_darts.config import surgery_block
    from mergekit_darts.errors import SurgeryConfigError

    if "surgery" not in text:  # cheap: most recipes have no block
        return []
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return []  # mergekit reports it
    stages = []
    for doc in docs:
        block = surgery_block(doc)
        if block is None:
            continue
        name = doc.get("name")
        if name is None and not kwargs["out_path"]:
            raise SurgeryConfigError(
                "mergekit-multi: the unnamed final stage has a surgery block; pass --out-path"
            )
        out = kwargs["out_path"] if name is None else os.path.join(kwargs["intermediate_dir"], name)
        stages.append(_Stage(name, out, block))
    return stages


def _prepare(
    multimerge: ModuleType, text: str, stages: list[_Stage], kwargs: dict[str, Any]
) -> list[tuple[_Stage, Any]]:
    """Check every stage's block before the first merge; drop stages ``--lazy`` leaves alone."""
    from mergekit_darts.hosts.mergekit.hook import prepare_merge_surgery, reference_model

    configs, _ = multimerge.load_config(text, kwargs["intermediate_dir"])
    outputs = {os.path.join(kwargs["intermediate_dir"], n): n for n in configs if n is not None}
    options = _options(kwargs)
    prepared = []
    for stage in stages:
        config = configs[stage.name]
        done = os.path.isdir(os.path.join(stage.out_path, "surgery"))
        if done and kwargs["lazy"] and _merged(multimerge, stage.out_path):
            log.warning(
                "mergekit-multi --lazy: stage %s and its surgery/ exist, both skipped "
                "(remove the folder or pass --no-lazy with DARTS_OVERWRITE_SURGERY=1 to redo)",
                stage.name or "final merge",
            )
            continue
        reference, stand_in, seen = reference_model(config), None, set()
        while reference in outputs and reference not in seen:  # an earlier stage's output:
            seen.add(reference)  # check against what that stage merges (cycles: mergekit's error)
            reference = stand_in = reference_model(configs[outputs[reference]])
        with _stage_errors(stage):
            ready = prepare_merge_surgery(
                stage.block, config, stage.out_path, options, reference=stand_in
            )
        prepared.append((stage, ready))
    return prepared


def _finish(prepared: list[tuple[_Stage, Any]], kwargs: dict[str, Any]) -> None:
    from mergekit_darts.hosts.mergekit.hook import finish_merge_surgery

    options = _options(kwargs)
    for stage, ready in prepared:
        with _stage_errors(stage):
            finish_merge_surgery(ready, stage.out_path, options)


def _options(kwargs: dict[str, Any]) -> Any:
    from mergekit.options import MergeOptions

    return MergeOptions(**{k: v for k, v in kwargs.items() if k in MergeOptions.model_fields})


def _merged(multimerge: ModuleType, out_path: str) -> bool:
    """What mergekit-multi's ``--lazy`` takes for a finished merge."""
    return os.path.exists(os.path.join(out_path, "config.json")) and any(
        os.path.exists(os.path.join(out_path, name)) for name in multimerge.MODEL_CHECK_FILENAMES
    )


def _stage_errors(stage: _Stage) -> AbstractContextManager[None]:
    """Prefix a surgery error with the stage it belongs to (click shows it on one line)."""
    from mergekit_darts.hosts.click_errors import one_line_errors

    return one_line_errors(f"mergekit-multi stage {stage.name or 'final merge'}: ")
