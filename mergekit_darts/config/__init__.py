"""The ``surgery:`` block of a merge YAML, read top-down:

- :mod:`~mergekit_darts.config.schema`: the pydantic models, key by key (no file or model access);
- :mod:`~mergekit_darts.config.resolve`: each task with the block's defaults filled in;
- :mod:`~mergekit_darts.config.parse`: reading the YAML and the rules between keys;
- :mod:`~mergekit_darts.config.preflight`: checks that open the files, configs and tokenizers the
  block names, before any merge work;

Every error is one line naming the key path (``surgery.tasks[0].calibration.max_length``) and how
to fix it (:mod:`mergekit_darts.messages`), because it surfaces from inside the stock ``mergekit-yaml`` and must arrive before any
merge work starts. The names below are the ones the rest of the package imports from here.
"""

from mergekit_darts.config.parse import (
    parse_surgery,
    read_surgery_file,
    read_yaml,
    resolve_device,
    surgery_block,
)
from mergekit_darts.config.preflight import (
    by_files,
    calibration_file,
    check_output,
    check_targets,
    model_shape,
    prompt_file,
)
from mergekit_darts.config.resolve import (
    JointPlan,
    ResolvedTask,
    check_folds,
    check_holdout,
    check_route_holdout,
    holdout_count,
    plan_joint,
    resolve_tasks,
    route_tasks,
)
from mergekit_darts.config.schema import (
    OVERRIDABLE,
    CacheDtype,
    CalibrationConfig,
    Candidate,
    LossName,
    LossPositions,
    ModuleKind,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    RouteConfig,
    StrictBlock,
    SurgeryConfig,
)

__all__ = [
    "CacheDtype",
    "CalibrationConfig",
    "Candidate",
    "LossName",
    "LossPositions",
    "ModuleKind",
    "NonNegativeInt",
    "OVERRIDABLE",
    "PositiveFloat",
    "PositiveInt",
    "JointPlan",
    "ResolvedTask",
    "RouteConfig",
    "StrictBlock",
    "SurgeryConfig",
    "by_files",
    "calibration_file",
    "check_folds",
    "check_holdout",
    "check_route_holdout",
    "check_output",
    "check_targets",
    "holdout_count",
    "model_shape",
    "parse_surgery",
    "plan_joint",
    "prompt_file",
    "read_surgery_file",
    "read_yaml",
    "resolve_device",
    "resolve_tasks",
    "route_tasks",
    "surgery_block",
]
