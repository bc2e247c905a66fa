"""The ``surgery:`` block's schema: keys, types, bounds and defaults, and nothing else.

Like mergekit's ``config.py``, this module only describes what may be written; it reads no file
and loads no model. The rules between keys live in :mod:`mergekit_darts.config.parse`, the
filled-in view of each task in :mod:`mergekit_darts.config.resolve`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    field_validator,
)

from mergekit_darts.correction.losses import LOSSES
from mergekit_darts.correction.spec import (
    DEFAULT_MAX_POSITIONS,
    DEFAULT_MODULE,
    DEFAULT_RANK,
    ModuleKind,
    PositiveInt,
)
from mergekit_darts.task_map import check_task_name

CALIBRATION_SUFFIXES = (".jsonl", ".json", ".txt", ".parquet")


def _not_bool(value: Any) -> Any:
    # YAML reads `1e-3` as a string, so floats stay lax, but `true` is never a learning rate.
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0), BeforeValidator(_not_bool)]
NonNegativeFloat = Annotated[float, Field(ge=0), BeforeValidator(_not_bool)]
Fraction = Annotated[float, Field(gt=0, lt=1), BeforeValidator(_not_bool)]
LossName = Literal[LOSSES]
LossPositions = Literal["all", "completion"]
CacheDtype = Literal["bfloat16", "float16", "float32"]
# exact: a target must have the merged model's token -> id map; prefix: it may append tokens
# after it (WizardMath-7B-V1.0 adds [PAD] as id 32000 to Llama-2's 32000) when every shared token
# keeps its id, since hidden-state losses never look at the extra rows. Either way embedding rows
# without a token (mergekit's tokenizer.pad_to_multiple_of) are accepted for l1/ewl1.
TargetVocab = Literal["exact", "prefix"]
# held-out selection metrics on the held-out prompts' tokens: top-1 agreement with the target
# (higher is better), KL(target || corrected merge) (lower), rho_L1 (higher); and the verdict's, on
# the target's own greedy completions of the judged prompts (calibrate.verdict): the share of
# prompts whose completion the corrected merge reproduces exactly (teacher-forced), per-prompt
# top-1 agreement and rho_L1 over the positions that predict the completion, and how many
# completion tokens it reproduces before the first it gets wrong
VERDICT_METRICS = (
    "completion_match",
    "completion_agreement",
    "completion_rho_l1",
    "completion_prefix",
)
# lm-eval's own score of each candidate on a development split of the task's eval_tasks
# (hosts.lm_eval_dev), tested against none like the verdict
LM_EVAL = "lm_eval"
SelectMetric = Literal["agreement", "kl", "rho_l1", *VERDICT_METRICS, LM_EVAL]
# the block's default candidates: the merge as it is, then Standard + L1 (Yang et al.),
# pos_corr + L1 and DARTS (pos_corr + EWL1), then the plain kinds (they fold into the
# checkpoint's own tensors: any engine serves them), each on the paper's loss. An architecture
# whose engines would lose a plain kind (correction.spec.plain_kind_problem) drops it from these.
DEFAULT_CANDIDATES = (
    {"module": "none"},
    {"module": "standard", "loss": "l1"},
    {"module": "pos_corr", "loss": "l1"},
    {"module": "pos_corr", "loss": "ewl1"},
    {"module": "head", "loss": "ewl1"},
    {"module": "norm", "loss": "ewl1"},
)
# the candidates under `plain: true` (corrections that fold into the checkpoint's own tensors): the
# merge as it is, the LM-head map and the final-norm scale, each on the paper's loss
PLAIN_CANDIDATES = (
    {"module": "none"},
    {"module": "head", "loss": "ewl1"},
    {"module": "norm", "loss": "ewl1"},
)


class StrictBlock(BaseModel):
    """A YAML mapping whose unknown keys are errors (a typo must not be silently dropped)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class CalibrationConfig(StrictBlock):
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


class Candidate(StrictBlock):
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


def _default_candidates() -> list[Candidate]:
    return [Candidate(**c) for c in DEFAULT_CANDIDATES]


def _mapping_or_off(key: str, off: str) -> Callable[[Any], Any]:
    """The before-validator of a key that takes a mapping of settings, or ``off`` (meaning
    ``off``): YAML 1.1 reads `off` as false; the string (JSON, Python) means the same."""

    def check(value: Any) -> Any:
        if value is False or value == "off":
            return False
        if value is None or isinstance(value, dict | BaseModel):
            return value
        raise ValueError(f"expected a mapping of {key} settings, or off ({off}); got {value!r}")

    return check


class DevSplit(StrictBlock):
    """``select.dev``: the lm-eval documents that judge the candidates under ``metric: lm_eval``.

    ``split`` names a split of each of the task's ``eval_tasks`` (gsm8k's ``train``), never the
    one lm-eval evaluates; ``indices`` (positions in that split) or ``limit`` (its first N)
    narrow it. ``include_path`` is a folder of task YAMLs, as ``lm_eval --include_path``.
    """

    split: str = Field(min_length=1)
    indices: list[NonNegativeInt] | None = Field(default=None, min_length=1)
    limit: PositiveInt | None = None
    include_path: str | None = None


DEFAULT_FOLDS = 5  # cross-fitting's folds: every calibration prompt is judged once
DEFAULT_HOLDOUT = 0.2  # the held-out share of a selection that holds one out instead of folds


class SelectConfig(StrictBlock):
    """Train every candidate on the prompts not judged; keep the best on the judged ones.

    ``folds`` (the default) cross-fits: the prompts are split into that many folds, each
    candidate is trained once per fold on the other folds and judged on it, so every prompt is
    judged once. A ``holdout`` share (here, on the task or, for the default selection, on the
    block; ``folds: null`` alone: :data:`DEFAULT_HOLDOUT`) judges instead. With a
    ``completion_*`` metric (the default) the judged prompts are completed by the target,
    ``{module: none}`` is always a candidate, and a correction is kept only when a one-sided
    signed-rank test over those prompts says it beats ``none`` (calibrate.verdict).
    """

    candidates: list[Candidate] = Field(default_factory=_default_candidates, min_length=1)
    holdout: Fraction | None = None  # one held-out share instead of folds
    folds: Annotated[StrictInt, Field(ge=2)] | None = DEFAULT_FOLDS
    metric: SelectMetric = "completion_prefix"
    completion_tokens: PositiveInt = 128  # the target's greedy completion of a judged prompt
    alpha: Fraction = 0.05  # family-wise level of the tests against none (Bonferroni)
    refit: StrictBool = True  # retrain the chosen settings on every prompt before saving
    dev: DevSplit | None = None  # metric lm_eval: the lm-eval documents that judge


def _select_kind(value: Any) -> str:
    return "select[off]" if value is False else "select[mapping]"


# `select: off` (false): no selection, the task's own module (the paper's recipe). The tags hold
# "[" so that messages drop them (messages.describe_error), as they drop pydantic's own.
SelectOrOff = Annotated[
    Annotated[
        Annotated[SelectConfig, Tag("select[mapping]")]
        | Annotated[Literal[False], Tag("select[off]")],
        Discriminator(_select_kind),
    ]
    | None,
    BeforeValidator(_mapping_or_off("select", "no selection")),
]


class TaskConfig(Candidate):
    """One surgery module: its target fine-tune, calibration data, and overrides of the defaults."""

    name: str
    target: str
    eval_tasks: list[str] | None = None
    calibration: CalibrationConfig
    holdout: Fraction | None = None
    select: SelectOrOff = None

    @field_validator("name")
    @classmethod
    def _file_and_cli_safe(cls, name: str) -> str:
        return check_task_name(name)

    @field_validator("eval_tasks")
    @classmethod
    def _mappable(cls, tasks: list[str] | None) -> list[str] | None:
        # surgery_map=gsm8k:math;humaneval:code splits on these characters.
        for number, task in enumerate(tasks or ()):
            if not task or any(c in task for c in ",;:= \t"):
                raise ValueError(f"{task!r} is not an lm-eval task name")
            if task in tasks[:number]:
                raise ValueError(f"lm-eval task {task!r} is listed twice; list it once")
        return tasks


class RouteConfig(StrictBlock):
    """``route:``: one gate over the tasks' corrections, fitted on the merged model's captures.

    ``tasks`` (default: every task of the block, in block order) are the gate's classes; a block
    holding several variants of one domain names one per domain. ``background`` is text that
    should get no correction (a last "none" class). ``holdout`` prompts of each class measure the
    gate; ``l2`` (on the standardised features) and ``steps`` (L-BFGS iterations) shape the fit.
    """

    tasks: list[str] | None = None
    holdout: Fraction = 0.2
    background: CalibrationConfig | None = None
    l2: NonNegativeFloat = 1e-3
    steps: PositiveInt = 100


class JointConfig(StrictBlock):
    """``joint:``: one plain correction fitted on several tasks' prompts at once, for one model
    that serves them all with no task id (calibrate.joint). ``tasks`` (default: every task of the
    block) are the tasks it is fitted on and judged by; a block holding several variants of one
    domain names one per domain. Without ``joint:`` it is fitted over every task whenever it can
    be (two or more tasks, a plain candidate common to all, judged alike); ``joint: off`` never.
    """

    tasks: list[str] | None = None


def _joint_kind(value: Any) -> str:
    return "joint[off]" if value is False else "joint[mapping]"


JointOrOff = Annotated[
    Annotated[
        Annotated[JointConfig, Tag("joint[mapping]")]
        | Annotated[Literal[False], Tag("joint[off]")],
        Discriminator(_joint_kind),
    ]
    | None,
    BeforeValidator(_mapping_or_off("joint", "no joint correction")),
]


class SurgeryConfig(StrictBlock):
    """The whole block; the training settings here are defaults every task may override."""

    module: ModuleKind = DEFAULT_MODULE
    loss: LossName = "ewl1"
    rank: PositiveInt = DEFAULT_RANK
    max_positions: PositiveInt = DEFAULT_MAX_POSITIONS
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
    cache_dir: str | None = None  # capture store on disk (calibrate.store); off by default
    holdout: Fraction | None = None
    select: SelectOrOff = None  # none: the default selection, unless module or loss is set
    route: RouteConfig | None = None  # one gate over the tasks (calibrate.fit_router)
    plain: StrictBool = False  # only corrections that fold into the checkpoint (any engine)
    joint: JointOrOff = None  # one plain correction of every task (calibrate.joint)
    tasks: list[TaskConfig] = Field(min_length=1)


def default(key: str) -> Any:
    """The block's default for ``key`` (one place: the training code's defaults read it too)."""
    return SurgeryConfig.model_fields[key].default


# The per-task training settings, in one list: a task or a select candidate may set each of them,
# and the block's value is the default.
OVERRIDABLE = tuple(Candidate.model_fields)
