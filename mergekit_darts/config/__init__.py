"""The ``surgery:`` block of a merge YAML: schema, defaults, and the checks run before merging.

Every error is one line naming the key path (``surgery.tasks[0].calibration.max_length``) and how
to fix it, because it surfaces from inside the stock ``mergekit-yaml`` and must arrive before any
merge work starts. Relative paths (targets, calibration files) resolve from the working directory,
the way mergekit resolves ``model:``, so ``model: ./math`` and ``target: ./math`` name one folder.
"""

from __future__ import annotations

import dataclasses
import os
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
)

from mergekit_darts.config.messages import describe_error, first_line
from mergekit_darts.core.losses import LOGIT_LOSSES, LOSSES
from mergekit_darts.core.modules import MODULE_KINDS
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.manifest import BLOCK_KEY
from mergekit_darts.routing import RESERVED_TASK_NAMES

CALIBRATION_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet")


def _not_bool(value: Any) -> Any:
    # YAML reads `1e-3` as a string, so floats stay lax, but `true` is never a learning rate.
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


PositiveInt = Annotated[StrictInt, Field(gt=0)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0), BeforeValidator(_not_bool)]
Fraction = Annotated[float, Field(gt=0, lt=1), BeforeValidator(_not_bool)]
ModuleKind = Literal[MODULE_KINDS]
LossName = Literal[LOSSES]
LossPositions = Literal["all", "completion"]
CacheDtype = Literal["bfloat16", "float16", "float32"]
# exact: a target must have the merged model's token -> id map; prefix: it may append tokens
# after it (WizardMath-7B-V1.0 adds [PAD] as id 32000 to Llama-2's 32000) when every shared token
# keeps its id, since hidden-state losses never look at the extra rows. Either way embedding rows
# without a token (mergekit's tokenizer.pad_to_multiple_of) are accepted for l1/ewl1.
TargetVocab = Literal["exact", "prefix"]
# held-out selection metrics: top-1 agreement with the target (higher is better), KL(target ||
# corrected merge) (lower), rho_L1 (higher)
SelectMetric = Literal["agreement", "kl", "rho_l1"]


class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CalibrationConfig(_Block):
    """Where a task's calibration prompts come from and how they become token sequences."""

    path: str | None = None
    dataset: str | None = None
    name: str | None = None  # the datasets configuration name
    split: str | None = None
    field: str | None = None
    template: str | None = None
    num_samples: PositiveInt = 50
    max_length: PositiveInt = 512
    continuation_tokens: NonNegativeInt = 0
    chat_template: StrictBool = False


class Candidate(_Block):
    """Training settings that override the task's: a task's own overrides, or one select candidate."""

    module: ModuleKind | None = None
    loss: LossName | None = None
    rank: PositiveInt | None = None
    max_positions: PositiveInt | None = None
    steps: PositiveInt | None = None
    lr: PositiveFloat | None = None
    batch_size: PositiveInt | None = None
    seed: NonNegativeInt | None = None
    loss_positions: LossPositions | None = None


class SelectConfig(_Block):
    """Train every candidate on the prompts not held out; keep the best on the held-out ones."""

    candidates: list[Candidate] = Field(min_length=1)
    holdout: Fraction = 0.2
    metric: SelectMetric = "agreement"
    refit: StrictBool = True  # retrain the chosen settings on every prompt before saving


class TaskConfig(Candidate):
    """One surgery module: its target fine-tune, calibration data, and overrides of the defaults."""

    name: str
    target: str
    eval_tasks: list[str] | None = None
    calibration: CalibrationConfig
    holdout: Fraction | None = None
    select: SelectConfig | None = None

    @field_validator("name")
    @classmethod
    def _file_and_cli_safe(cls, name: str) -> str:
        # The name becomes a file name and a value inside lm-eval's comma-split --model_args.
        allowed = set(string.ascii_letters + string.digits + "_.-")
        if not name or not name[0].isalnum() or not set(name) <= allowed:
            raise ValueError(
                f"{name!r} is not a valid task name; use letters, digits, '_', '.', '-' and "
                "start with a letter or digit"
            )
        if name.lower() in RESERVED_TASK_NAMES:
            raise ValueError(f"{name!r} is reserved by hf-darts (surgery=none|auto); rename it")
        return name

    @field_validator("eval_tasks")
    @classmethod
    def _mappable(cls, tasks: list[str] | None) -> list[str] | None:
        # surgery_map=gsm8k:math;humaneval:code splits on these characters.
        for task in tasks or ():
            if not task or any(c in task for c in ",;:= \t"):
                raise ValueError(f"{task!r} is not an lm-eval task name")
        return tasks


class SurgeryConfig(_Block):
    """The whole block; the training settings here are defaults every task may override."""

    module: ModuleKind = "pos_corr"
    loss: LossName = "ewl1"
    rank: PositiveInt = 16
    max_positions: PositiveInt = 512
    steps: PositiveInt = 500
    lr: PositiveFloat = 1e-3
    batch_size: PositiveInt = 8
    seed: NonNegativeInt = 0
    loss_positions: LossPositions = "all"
    device: str = "auto"
    device_map: str | None = None
    cache_dtype: CacheDtype = "bfloat16"
    trust_remote_code: StrictBool = False
    target_vocab: TargetVocab = "exact"
    cache_dir: str | None = None  # capture store on disk (mergekit_darts.store); off by default
    holdout: Fraction | None = None
    select: SelectConfig | None = None
    tasks: list[TaskConfig] = Field(min_length=1)


OVERRIDABLE = tuple(Candidate.model_fields)


@dataclass(frozen=True)
class ResolvedTask:
    """A task with every default filled in and its key path, for messages."""

    index: int
    name: str
    target: str  # as written in the YAML (recorded in the manifest)
    eval_tasks: tuple[str, ...]
    calibration: CalibrationConfig
    module: str
    loss: str
    rank: int
    max_positions: int
    steps: int
    lr: float
    batch_size: int
    seed: int
    loss_positions: str
    overridden: frozenset[str]  # settings the task sets itself
    holdout: float = 0.0  # fraction of prompts held out from training (0: none)
    holdout_key: str = ""  # where the holdout was set, for messages
    select: SelectConfig | None = None
    select_key: str = ""

    @property
    def key(self) -> str:
        return f"surgery.tasks[{self.index}]"

    def candidates(self) -> list[ResolvedTask]:
        """The task as each select candidate trains it (no select: the task itself)."""
        if self.select is None:
            return [self]
        return [
            dataclasses.replace(
                self,
                select=None,
                overridden=self.overridden | set(c.model_fields_set),
                **c.model_dump(exclude_none=True),
            )
            for c in self.select.candidates
        ]

    @property
    def needs_logits(self) -> bool:
        """True when training or selection compares next-token distributions (kl, ce, metric)."""
        metric = self.select is not None and self.select.metric != "rho_l1"
        return metric or any(c.loss in LOGIT_LOSSES for c in self.candidates())

    @property
    def needs_head(self) -> bool:
        """Capture the output heads: logits are needed, or held-out agreement / KL are reported."""
        return self.needs_logits or self.holdout > 0

    def source_key(self, setting: str) -> str:
        """Key path where ``setting`` was set: the task's override or the block default."""
        return f"{self.key}.{setting}" if setting in self.overridden else f"surgery.{setting}"


def resolve_tasks(config: SurgeryConfig) -> list[ResolvedTask]:
    """Fill each task's unset settings from the block's defaults."""
    resolved = []
    for index, task in enumerate(config.tasks):
        settings = {
            name: getattr(config, name) if getattr(task, name) is None else getattr(task, name)
            for name in OVERRIDABLE
        }
        resolved.append(
            ResolvedTask(
                index=index,
                name=task.name,
                target=task.target,
                eval_tasks=tuple(task.eval_tasks or [task.name]),
                calibration=task.calibration,
                overridden=frozenset(n for n in OVERRIDABLE if getattr(task, n) is not None),
                **settings,
                **_split(config, task, f"surgery.tasks[{index}]"),
            )
        )
    return resolved


def _split(config: SurgeryConfig, task: TaskConfig, key: str) -> dict[str, Any]:
    """A task's select and holdout: its own values win over the block's."""
    for level, where in ((task, key), (config, "surgery")):
        if level.select is not None and level.holdout is not None:
            raise SurgeryConfigError(
                f"{where}.holdout: {where}.select.holdout sets the held-out fraction here; "
                "give it in one place"
            )
    select, select_key = (task.select, f"{key}.select") if task.select else (config.select, "")
    if select is not None and not select_key:
        select_key = "surgery.select"
    if task.holdout is not None:
        holdout, holdout_key = task.holdout, f"{key}.holdout"
    elif select is not None:
        holdout, holdout_key = select.holdout, f"{select_key}.holdout"
    else:
        holdout, holdout_key = config.holdout or 0.0, "surgery.holdout"
    return {
        "holdout": holdout,
        "holdout_key": holdout_key,
        "select": select,
        "select_key": select_key,
    }


def holdout_count(fraction: float, n: int) -> int:
    """Prompts held out of ``n``: ``round(fraction * n)``, at least one when holding out at all."""
    return 0 if fraction <= 0 else max(1, round(fraction * n))


def check_holdout(task: ResolvedTask, num_prompts: int) -> None:
    """The split must leave a prompt on each side; run once the prompts are read."""
    held = holdout_count(task.holdout, num_prompts)
    if held and held >= num_prompts:
        raise SurgeryConfigError(
            f"{task.holdout_key}: {task.holdout} of {num_prompts} prompt(s) holds out {held}, "
            "leaving no prompt to train on; lower it or give more calibration prompts"
        )


# ---- reading the block ---------------------------------------------------------------------------


def surgery_block(source: str | Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The raw ``surgery:`` mapping of a merge YAML (text or parsed), or None when there is none."""
    if source is None:
        return None
    if isinstance(source, str):
        if "surgery" not in source:  # cheap: most merges have no block
            return None
        source = yaml.safe_load(source)
    if not isinstance(source, Mapping) or "surgery" not in source:
        return None
    block = source["surgery"]
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
    seen: dict[str, str] = {}
    served: dict[str, str] = {}
    for task in resolve_tasks(config):
        if task.name in seen:
            raise SurgeryConfigError(
                f"{task.key}.name: duplicate task name {task.name!r} (also {seen[task.name]}); "
                "each task needs its own name"
            )
        seen[task.name] = task.key
        for eval_task in task.eval_tasks:
            if eval_task in served:
                raise SurgeryConfigError(
                    f"{task.key}.eval_tasks: lm-eval task {eval_task!r} is already served by task "
                    f"{served[eval_task]!r}; each lm-eval task may pick one module"
                )
            served[eval_task] = task.name
        for number, candidate in enumerate(task.candidates()):
            try:
                _check_calibration(candidate)
            except SurgeryConfigError as err:
                if task.select is None:
                    raise
                raise SurgeryConfigError(f"{task.select_key}.candidates[{number}]: {err}") from None
    _check_device(config.device)


def _check_calibration(task: ResolvedTask) -> None:
    cal, key = task.calibration, f"{task.key}.calibration"
    if (cal.path is None) == (cal.dataset is None):
        raise SurgeryConfigError(
            f"{key}: give exactly one source, `path:` (a .jsonl/.json/.txt/.parquet file) or "
            "`dataset:` (+ `split:`)"
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
    if cal.max_length > task.max_positions:
        raise SurgeryConfigError(
            f"{key}.max_length: {cal.max_length} exceeds max_positions {task.max_positions} "
            "(the position table cannot cover it); lower max_length or raise max_positions"
        )
    if cal.continuation_tokens >= cal.max_length:
        raise SurgeryConfigError(
            f"{key}.continuation_tokens: {cal.continuation_tokens} leaves no room for the prompt "
            f"within max_length {cal.max_length}; prompt + completion must fit max_length"
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
    names = [name for _, name, _, _ in parts if name is not None]
    if not names:
        raise SurgeryConfigError(
            f"{key}: names no {{field}} of the records; e.g. 'Q: {{question}}'"
        )
    for name in names:
        if not name.isidentifier():
            raise SurgeryConfigError(
                f"{key}: {{{name}}} is not a plain field name; use {{field}} placeholders only"
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


# ---- files and models the block names ------------------------------------------------------------


def local_or_hub(ref: str, key: str) -> str:
    """An absolute folder path for a local model, or ``ref`` itself for a Hub id."""
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SurgeryConfigError(f"{key}: {ref} is a file; name the model's folder")
        return str(path.resolve())
    # mergekit's rule (mergekit.card.is_hf): anything else may be a Hub id such as gpt2 or org/name
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise SurgeryConfigError(
            f"{key}: no model folder at {path.resolve()} (relative paths resolve from the "
            f"working directory {os.getcwd()})"
        )
    return ref


def calibration_file(task: ResolvedTask) -> Path | None:
    """The calibration file of a ``path:`` source, checked to exist and have a known suffix."""
    cal, key = task.calibration, f"{task.key}.calibration.path"
    if cal.path is None:
        return None
    path = Path(cal.path).expanduser().resolve()
    if path.suffix.lower() not in CALIBRATION_SUFFIXES:
        raise SurgeryConfigError(
            f"{key}: {cal.path} has an unsupported suffix; use one of "
            f"{', '.join(CALIBRATION_SUFFIXES)}"
        )
    if not path.is_file():
        raise SurgeryConfigError(
            f"{key}: no file at {path} (relative paths resolve from the working directory "
            f"{os.getcwd()})"
        )
    if path.stat().st_size == 0:
        raise SurgeryConfigError(f"{key}: {cal.path} is empty; give it at least one prompt")
    return path


@dataclass(frozen=True)
class ModelShape:
    """What surgery needs to know about a model without loading its weights."""

    hidden_size: int | None
    vocab_size: int | None


def model_shape(ref: str, key: str, *, trust_remote_code: bool) -> ModelShape:
    """Hidden and vocabulary size from the model's config.json (no weights are read)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(ref, trust_remote_code=trust_remote_code)
    except Exception as err:  # OSError, ValueError, hub errors: all mean "cannot use it"
        local = "" if Path(ref).exists() else f"; there is no folder {Path(ref).resolve()} either"
        raise SurgeryConfigError(
            f"{key}: cannot read a model config from {ref!r}: {first_line(str(err))}{local}"
        ) from None
    text = config.get_text_config(decoder=True)
    return ModelShape(getattr(text, "hidden_size", None), getattr(text, "vocab_size", None))


def check_targets(
    tasks: list[ResolvedTask],
    reference: str,
    reference_label: str,
    *,
    trust_remote_code: bool,
    check_vocab: bool = True,
    target_vocab: str = "exact",
) -> dict[str, str]:
    """Check each target against ``reference`` (the base before merging, the merge after).

    Returns each task's resolved target location. With ``check_vocab`` the vocabularies are
    compared too (:func:`_check_vocab`): calibration feeds one sequence of token ids to both.
    """
    ref_shape = model_shape(reference, reference_label, trust_remote_code=trust_remote_code)
    ref_vocab = _tokenizer_vocab(reference, trust_remote_code) if check_vocab else None
    located = {}
    for task in tasks:
        key = f"{task.key}.target"
        where = local_or_hub(task.target, key)
        shape = model_shape(where, key, trust_remote_code=trust_remote_code)
        if shape.hidden_size != ref_shape.hidden_size:
            raise SurgeryConfigError(
                f"{key}: {task.target} has hidden_size {shape.hidden_size}, the {reference_label} "
                f"has {ref_shape.hidden_size}; surgery needs targets of the merged architecture"
            )
        if check_vocab:
            tokens = _tokenizer_vocab(where, trust_remote_code)
            _check_vocab(task, shape, ref_shape, tokens, ref_vocab, reference_label, target_vocab)
        located[task.name] = where
    return located


def _check_vocab(
    task: ResolvedTask,
    shape: ModelShape,
    ref_shape: ModelShape,
    tokens: dict[str, int] | None,
    ref_vocab: dict[str, int] | None,
    reference_label: str,
    target_vocab: str,
) -> None:
    """The vocabulary rules between a target and the reference.

    The token -> id maps decide (equal, or under ``prefix`` every reference token keeping its id
    in the target); embedding row counts may differ, since rows without a token (mergekit's
    ``tokenizer.pad_to_multiple_of``, appended tokens) never meet a calibration id and the
    hidden-state losses never look at them. ``kl``/``ce`` compare the two heads' distributions
    over one vocabulary, so they need equal row counts as well. Without both tokenizers only the
    row counts can be compared.
    """
    key, target, ref = f"{task.key}.target", task.target, reference_label
    sizes = f"{target} has vocab_size {shape.vocab_size}, the {ref} has {ref_shape.vocab_size}"
    if task.needs_logits and shape.vocab_size != ref_shape.vocab_size:
        losses = sorted({c.loss for c in task.candidates()} & set(LOGIT_LOSSES))
        why = f"loss {'/'.join(losses)}" if losses else f"select metric {task.select.metric}"
        raise SurgeryConfigError(
            f"{key}: {sizes}; {why} compares the two models' distributions over one vocabulary "
            "and needs equal sizes; use loss l1 or ewl1 (and select metric rho_l1), which accept "
            "padded embedding rows and (with surgery.target_vocab: prefix) appended tokens"
        )
    prefix = target_vocab == "prefix" and not task.needs_logits
    if tokens is None or ref_vocab is None:
        if shape.vocab_size == ref_shape.vocab_size or (
            prefix and shape.vocab_size > ref_shape.vocab_size
        ):
            return
        hint = (
            "; a target that only appends tokens is accepted with surgery.target_vocab: prefix"
            if not prefix and shape.vocab_size > ref_shape.vocab_size
            else ""
        )
        raise SurgeryConfigError(
            f"{key}: {sizes}, and without both tokenizers their token ids cannot be compared{hint}"
        )
    shared = {t: tokens.get(t) for t in ref_vocab}
    keeps_ids = shared == ref_vocab
    compared = shared if prefix else tokens
    if compared != ref_vocab:
        differ = len(set(ref_vocab.items()) ^ set(compared.items()))
        hint = (
            "; it keeps every token's id and adds tokens: set surgery.target_vocab: prefix"
            if keeps_ids and not task.needs_logits
            else ""
        )
        raise SurgeryConfigError(
            f"{key}: the tokenizer of {target} ({len(tokens)} tokens, vocab_size "
            f"{shape.vocab_size}) differs from the {ref}'s ({len(ref_vocab)} tokens, vocab_size "
            f"{ref_shape.vocab_size}): {differ} token/id pairs differ; calibration feeds the same "
            f"token ids to both{hint}"
        )
    top = max(ref_vocab.values(), default=-1)
    if shape.vocab_size is not None and top >= shape.vocab_size:
        raise SurgeryConfigError(
            f"{key}: the {ref}'s tokenizer has token ids up to {top}, but {target} has only "
            f"{shape.vocab_size} embedding rows"
        )


def _tokenizer_vocab(ref: str, trust_remote_code: bool) -> dict[str, int] | None:
    """The token -> id map, or None when the folder has no tokenizer to compare.

    Warns when transformers loads a tokenizer that encodes unlike the folder's tokenizer.json
    (transformers 5 and ``model_type: qwen2``; README, Known issues): the maps may still agree.
    """
    from transformers import AutoTokenizer

    from mergekit_darts.integrations.upstream import warn_tokenizer_mismatch

    def vocab() -> dict[str, int] | None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(ref, trust_remote_code=trust_remote_code)
        except Exception:  # no tokenizer files: nothing to compare, the vocab_size check remains
            return None
        warn_tokenizer_mismatch(ref, tokenizer)
        return tokenizer.get_vocab()

    return by_files(_VOCABS, ref, trust_remote_code, vocab)


_VOCABS: dict[Any, Any] = {}


def by_files(cache: dict[Any, Any], ref: str, trust_remote_code: bool, make: Any) -> Any:
    """``make()``, cached under the (name, size, mtime_ns) of ``ref``'s files.

    A sweep checks and tokenizes with the same models in every cell, each cell's model folder
    linking the same files: they are read once, and again as soon as a file changes.
    """
    folder = Path(ref)
    files = sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []
    stamp = tuple((p.name, (st := p.stat()).st_size, st.st_mtime_ns) for p in files) or ref
    key = (stamp, trust_remote_code)
    if key not in cache:
        if len(cache) >= 16:
            cache.clear()
        cache[key] = make()
    return cache[key]


def check_output(out_path: str | Path, overwrite: bool) -> None:
    """Refuse to replace an existing ``surgery/`` folder unless asked to."""
    folder = Path(out_path) / "surgery"
    if folder.exists() and not overwrite:
        raise SurgeryConfigError(
            f"{folder} already exists: pass --overwrite-surgery (mergekit-darts merge), "
            "--overwrite (mergekit-darts calibrate), set DARTS_OVERWRITE_SURGERY=1 (mergekit-yaml), "
            "or remove it"
        )


# ---- messages ------------------------------------------------------------------------------------
