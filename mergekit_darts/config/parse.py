"""Reading the block from YAML and checking the rules between its keys.

The schema checks each key alone; here come the rules that span keys (one calibration source,
``max_length`` within ``max_positions``, one module per lm-eval task, ...). Nothing here opens a
model or a calibration file: :mod:`mergekit_darts.config.preflight` does that, so a block can be
checked in milliseconds before mergekit starts.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from mergekit_darts.config.resolve import ResolvedTask, joint_tasks, plan_joint, resolve_tasks
from mergekit_darts.config.schema import CALIBRATION_SUFFIXES, CalibrationConfig, SurgeryConfig
from mergekit_darts.correction.darts_correction import PLAIN_KINDS
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.folder.manifest import BLOCK_KEY
from mergekit_darts.messages import describe_error, first_line
from mergekit_darts.task_map import DoubleClaim, eval_task_map

# Prompt tokens a calibration row needs: the first position is the BOS token for most tokenizers,
# the same hidden state in every prompt, so a row needs at least one token after it to teach the
# module anything (and its greedy completion to differ between prompts).
MIN_PROMPT_TOKENS = 2


def surgery_block(source: str | Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The raw ``surgery:`` mapping of a merge YAML (text or parsed), or None when there is none."""
    if source is None:
        return None
    if isinstance(source, str):
        if BLOCK_KEY not in source:  # cheap: most merges have no block
            return None
        source = yaml.safe_load(source)
    if not isinstance(source, Mapping) or BLOCK_KEY not in source:
        return None
    block = source[BLOCK_KEY]
    if not isinstance(block, Mapping):
        raise SurgeryConfigError(
            "surgery: expected a mapping with a `tasks:` list; remove the key to merge without "
            "surgery"
        )
    return block


def read_yaml(path: Path) -> Any:
    """``yaml.safe_load`` of a file, with read and syntax errors as one-line config errors."""
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise SurgeryConfigError(f"cannot read {path}: {err.strerror or err}") from err
    except yaml.YAMLError as err:
        raise SurgeryConfigError(f"{path} is not valid YAML: {first_line(str(err))}") from err


def read_surgery_file(path: str | Path) -> Mapping[str, Any]:
    """The block from a YAML file holding either a whole merge config with ``surgery:`` or the block."""
    path = Path(path)
    data = read_yaml(path)
    block = surgery_block(data)
    if block is None and isinstance(data, Mapping) and "tasks" in data:
        block = data
    if block is None:
        raise SurgeryConfigError(
            f"{path} holds no surgery block: give a merge YAML with a `surgery:` key or the block "
            "itself (a mapping with `tasks:`)"
        )
    return block


def parse_surgery(block: SurgeryConfig | Mapping[str, Any]) -> SurgeryConfig:
    """Validate the block's schema and the rules between its keys; no file or model is touched."""
    if isinstance(block, SurgeryConfig):
        config = block
    else:
        try:
            config = SurgeryConfig.model_validate(dict(block))
        except ValidationError as err:
            raise SurgeryConfigError(describe_error(err, SurgeryConfig, BLOCK_KEY)) from None
    _check_rules(config)
    return config


def _check_rules(config: SurgeryConfig) -> None:
    """Names, then lm-eval served, then each task's (or candidate's) calibration, then device."""
    tasks = resolve_tasks(config)
    seen: dict[str, str] = {}
    for task in tasks:
        if task.name in seen:
            raise SurgeryConfigError(
                f"{task.key}.name: duplicate task name {task.name!r} (also {seen[task.name]}); "
                "each task needs its own name"
            )
        seen[task.name] = task.key
    try:
        eval_task_map((task.name, task.eval_tasks) for task in tasks)
    except DoubleClaim as claim:
        task = next(task for task in tasks if task.name == claim.second)
        raise SurgeryConfigError(
            f"{task.key}.eval_tasks: lm-eval task {claim.eval_task!r} is already served by task "
            f"{claim.first!r}; each lm-eval task may pick one module"
        ) from None
    if config.plain:
        _check_plain(tasks)
    for task in tasks:
        if task.select is None:
            _check_calibration(task)
            continue
        for number, candidate in enumerate(task.select.candidates):
            try:
                _check_calibration(task.as_candidate(candidate))
            except SurgeryConfigError as err:
                if not candidate.model_fields_set & {"max_positions", "loss_positions"}:
                    raise  # about the task's own keys, whatever the candidate
                raise SurgeryConfigError(f"{task.select_key}.candidates[{number}]: {err}") from None
    _check_route(config, tasks)
    _check_joint(config, tasks)
    _check_device(config.device)


def _check_plain(tasks: list[ResolvedTask]) -> None:
    """Under ``plain: true`` every module a task may keep folds into the checkpoint."""
    allowed = ("none", *PLAIN_KINDS)
    for task in tasks:
        numbered = enumerate(task.select.candidates) if task.select is not None else [(None, None)]
        for number, candidate in numbered:
            module = (task if candidate is None else task.as_candidate(candidate)).module
            if module in allowed:
                continue
            key = (
                task.source_key("module")
                if candidate is None or candidate.module is None
                else f"{task.select_key}.candidates[{number}].module"
            )
            raise SurgeryConfigError(
                f"{key}: {module} does not fold into the checkpoint's weights, which plain: true "
                f"asks for; use module: {' or '.join(PLAIN_KINDS)}, or drop plain: true"
            )


def _check_joint(config: SurgeryConfig, tasks: list[ResolvedTask]) -> None:
    """``joint.tasks`` names two or more distinct block tasks, and a written ``joint:`` can be
    fitted (``plan_joint`` says why not)."""
    joint = config.joint
    if not joint:
        return
    names = [task.name for task in tasks]
    _check_named_tasks("surgery.joint.tasks", joint.tasks or [], names)
    count = len(joint_tasks(config))
    if count < 2:
        raise SurgeryConfigError(
            f"surgery.joint: a joint correction serves two or more tasks, {count} named; name "
            "more tasks or remove `joint:`"
        )
    plan_joint(config, tasks)


def _check_named_tasks(key: str, named: list[str], names: list[str]) -> None:
    """Each task ``key`` names is one of the block's ``names``, named once."""
    for number, name in enumerate(named):
        if name not in names:
            raise SurgeryConfigError(
                f"{key}[{number}]: no task named {name!r} in the block (it has {', '.join(names)})"
            )
        if name in named[:number]:
            raise SurgeryConfigError(
                f"{key}[{number}]: task {name!r} is listed twice; list it once"
            )


def _check_route(config: SurgeryConfig, tasks: list[ResolvedTask]) -> None:
    """``route:`` weighs two or more distinct block tasks; its background is a prompt source
    like a task's calibration, without completions (no target generates for it)."""
    route = config.route
    if route is None:
        return
    names = [task.name for task in tasks]
    if route.tasks is None and len(names) < 2:
        raise SurgeryConfigError(
            f"surgery.route: a router weighs two or more tasks, the block has {len(names)} "
            f"({', '.join(names)}); add a task or remove `route:`"
        )
    _check_named_tasks("surgery.route.tasks", route.tasks or [], names)
    if route.tasks is not None and len(route.tasks) < 2:
        raise SurgeryConfigError(
            f"surgery.route.tasks: a router weighs two or more tasks, {len(route.tasks)} named; "
            "name another or leave the key out (every task of the block)"
        )
    if route.background is not None:
        key = "surgery.route.background"
        check_source(route.background, key)
        if route.background.continuation_tokens:
            raise SurgeryConfigError(
                f"{key}.continuation_tokens: background text is captured on the merged model "
                "only, with no target to generate a completion; remove the key"
            )


def check_source(cal: CalibrationConfig, key: str) -> None:
    """The rules of one prompt source (a task's calibration, route's background) at ``key``."""
    if (cal.path is None) == (cal.dataset is None):
        raise SurgeryConfigError(
            f"{key}: give exactly one source, `path:` (a {'/'.join(CALIBRATION_SUFFIXES)} file) "
            "or `dataset:` (+ `split:`)"
        )
    if cal.dataset is not None and cal.split is None:
        raise SurgeryConfigError(f"{key}.split: required with `dataset:` (e.g. split: train)")
    if cal.path is not None and (cal.split is not None or cal.name is not None):
        extra = "split" if cal.split is not None else "name"
        raise SurgeryConfigError(f"{key}.{extra}: only applies to `dataset:`; remove it")
    if cal.field is not None and cal.template is not None:
        raise SurgeryConfigError(f"{key}.template: give `field:` or `template:`, not both")
    if cal.template is not None:
        _check_template(cal.template, f"{key}.template")
    if cal.max_length < MIN_PROMPT_TOKENS:
        raise SurgeryConfigError(
            f"{key}.max_length: {cal.max_length} leaves no token to train on after the first "
            f"(BOS) token, whose state is the same in every prompt; use at least "
            f"{MIN_PROMPT_TOKENS}"
        )


def _check_calibration(task: ResolvedTask) -> None:
    cal, key = task.calibration, f"{task.key}.calibration"
    check_source(cal, key)
    if cal.max_length > task.max_positions:
        raise SurgeryConfigError(
            f"{key}.max_length: {cal.max_length} exceeds max_positions {task.max_positions} "
            "(the position table cannot cover it); lower max_length or raise max_positions"
        )
    if cal.max_length - cal.continuation_tokens < MIN_PROMPT_TOKENS:
        raise SurgeryConfigError(
            f"{key}.continuation_tokens: {cal.continuation_tokens} leaves no room for the prompt "
            f"within max_length {cal.max_length}; prompt + completion must fit max_length, with "
            f"at least {MIN_PROMPT_TOKENS} prompt tokens (BOS and one more)"
        )
    if task.loss_positions == "completion" and cal.continuation_tokens == 0:
        raise SurgeryConfigError(
            f"{task.source_key('loss_positions')}: `completion` needs "
            f"{key}.continuation_tokens > 0 (task {task.name!r} has no completion to train on)"
        )


def _check_template(template: str, key: str) -> None:
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as err:
        raise SurgeryConfigError(f"{key}: {err}; write literal braces as {{{{ and }}}}") from None
    fields = [(name, spec, conv) for _, name, spec, conv in parts if name is not None]
    if not fields:
        raise SurgeryConfigError(
            f"{key}: names no {{field}} of the records; e.g. 'Q: {{question}}'"
        )
    for name, spec, conversion in fields:
        if not name.isidentifier():
            raise SurgeryConfigError(
                f"{key}: {{{name}}} is not a plain field name; use {{field}} placeholders only"
            )
        # A format spec or conversion fails or changes meaning with the records' value types,
        # which are known only per record: plain placeholders insert each value as text.
        if spec or conversion:
            written = (
                f"{{{name}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}"
            )
            raise SurgeryConfigError(
                f"{key}: {written} has a format spec or conversion; use the plain placeholder "
                f"{{{name}}}, which inserts the value as text"
            )


def _check_device(device: str) -> None:
    import torch

    if device == "auto":
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise SurgeryConfigError(
            f"surgery.device: {device!r} is not a device; use auto, cpu, cuda or cuda:N"
        ) from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise SurgeryConfigError(
            f"surgery.device: {device!r} asked for, but torch sees no CUDA device; use auto or cpu"
        )


def resolve_device(device: str) -> str:
    """``auto`` means CUDA when torch sees one, else the CPU."""
    import torch

    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"
