"""The demo's merge YAMLs: four mergekit methods, each with one `surgery:` block.

One block holds every surgery variant the table compares, as separate tasks with overrides
(`code` = DARTS, `code_std` = Standard + L1, `code_head` / `code_norm` = the plain kinds,
`_select` = the block's default: the held-out verdict over its default candidates
(config.schema.DEFAULT_CANDIDATES, calibrate.verdict); with `--full` also
`code_pos_l1` = pos_corr + L1
and `_cont` = calibrated on the target's own completions), plus a `route:` over the three DARTS
tasks (generic text as background) and a `joint:` over the three `_select` tasks (one plain
correction for every domain, with no task id), so a single stock `mergekit-yaml` run per method
produces all of them. The long scale's rows are paper Table 10's grid instead (`long_rows`: also
`code_std_ewl1` = Standard + EWL1 and `code_cont_answer` = DARTS calibrated on the target's
whole answers).
Paths are written relative to the working directory, the way mergekit resolves `model:`.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from demo.domains import DOMAIN_NAMES

# method -> per-expert parameters, and whether the method takes the base model (linear does not)
METHODS: dict[str, tuple[dict[str, float], bool]] = {
    "task_arithmetic": ({"weight": 0.5}, True),
    "linear": ({"weight": 1.0}, False),  # plain average of the experts (mergekit normalises)
    "ties": ({"weight": 0.5, "density": 0.7}, True),
    "dare_ties": ({"weight": 0.5, "density": 0.7}, True),
}


@dataclass(frozen=True)
class Variant:
    """One surgery setting of the table: a task-name suffix plus its overrides."""

    label: str
    suffix: str
    overrides: dict[str, Any]
    continuation_tokens: int = 0

    @property
    def selects(self) -> bool:
        return "select" in self.overrides

    @property
    def plain(self) -> bool:
        """A plain kind: folds into the checkpoint's own tensors, so any engine serves it."""
        return self.overrides.get("module") in PLAIN_MODULES


CONTINUATION_TOKENS = 32
STANDARD_L1 = {"module": "standard", "loss": "l1"}
STANDARD_EWL1 = {"module": "standard", "loss": "ewl1"}
POS_CORR_L1 = {"module": "pos_corr", "loss": "l1"}
DARTS = {"module": "pos_corr", "loss": "ewl1"}
HEAD_EWL1 = {"module": "head", "loss": "ewl1"}
NORM_EWL1 = {"module": "norm", "loss": "ewl1"}
PLAIN_MODULES = (HEAD_EWL1["module"], NORM_EWL1["module"])  # darts_correction.PLAIN_KINDS
NO_CORRECTION = {"module": "none"}
# the block's default candidates, config.schema.DEFAULT_CANDIDATES (the merge as it is, then each
# fixed variant `fixed_variant` finds), as its `select` rows' candidates: they train on the same
# captures as those rows, and the rest is the default verdict too, so the `select` rows are what
# a block without module, loss or select gets. Written out, not imported: this module builds
# YAML before the demo's pins are set, and mergekit_darts starts torch (tests/test_demo_run.py
# checks they are the same)
SELECT = {
    "candidates": [NO_CORRECTION, STANDARD_L1, POS_CORR_L1, DARTS, HEAD_EWL1, NORM_EWL1],
}
STANDARD_L1_ROW = Variant("Standard + L1 (Yang et al.)", "_std", STANDARD_L1)
DARTS_ROW = Variant("DARTS (pos_corr + EWL1)", "", DARTS)
# the plain kinds: they fold into the checkpoint's own tensors (LM head, final norm)
HEAD_ROW = Variant("head + EWL1 (plain)", "_head", HEAD_EWL1)
NORM_ROW = Variant("norm + EWL1 (plain)", "_norm", NORM_EWL1)
PLAIN_ROWS = (HEAD_ROW, NORM_ROW)
SELECT_ROW = Variant(
    "select (none, Standard + L1, pos_corr + L1, DARTS, head, norm; held-out verdict: the default)",
    "_select",
    {"select": SELECT},
)
POS_CORR_L1_ROW = Variant("pos_corr + L1 (ablation, paper Table 10)", "_pos_l1", POS_CORR_L1)
STANDARD_EWL1_ROW = Variant(
    "Standard + EWL1 (ablation, paper Table 10)", "_std_ewl1", STANDARD_EWL1
)
# the headline rows (paper Table 1, the plain kinds and `select`; the routed and joint rows are
# added per merge by run.py)
HEADLINE: tuple[Variant, ...] = (STANDARD_L1_ROW, DARTS_ROW, *PLAIN_ROWS, SELECT_ROW)
ROUTED_LABEL = "routed DARTS (no task id)"
JOINT_LABEL = "joint plain (no task id)"
BACKGROUND_SAMPLES = 50  # generic prompts the router learns to leave uncorrected
# `--full`: the ablations (paper Table 10) and generation-aware calibration
ABLATIONS: tuple[Variant, ...] = (
    POS_CORR_L1_ROW,
    Variant("Standard + L1, +completions", "_std_cont", STANDARD_L1, CONTINUATION_TOKENS),
    Variant("pos_corr + L1, +completions", "_pos_l1_cont", POS_CORR_L1, CONTINUATION_TOKENS),
    Variant("DARTS, +completions", "_cont", DARTS, CONTINUATION_TOKENS),
    Variant("head + EWL1 (plain), +completions", "_head_cont", HEAD_EWL1, CONTINUATION_TOKENS),
    Variant("norm + EWL1 (plain), +completions", "_norm_cont", NORM_EWL1, CONTINUATION_TOKENS),
    Variant("select, +completions", "_select_cont", {"select": SELECT}, CONTINUATION_TOKENS),
)
VARIANTS: tuple[Variant, ...] = HEADLINE + ABLATIONS
LONG = "long"  # the `--scale` of long answers: its rows are paper Table 10's grid
# DARTS calibrated on the target's whole answers (the long scale's generation limit)
WHOLE_ANSWER_SUFFIX = "_cont_answer"


def long_rows(generation_limit: int) -> tuple[Variant, ...]:
    """Paper Table 10 on long answers: {L1, EWL1} x {standard, pos_corr}, DARTS calibrated on
    the target's completions as long as the evaluation lets it generate (its whole answer), the
    plain kinds, and the default (`select`)."""
    whole = Variant(
        f"DARTS, +completions ({generation_limit} tokens: the whole answer)",
        WHOLE_ANSWER_SUFFIX,
        DARTS,
        generation_limit,
    )
    return (
        STANDARD_L1_ROW,
        STANDARD_EWL1_ROW,
        POS_CORR_L1_ROW,
        DARTS_ROW,
        whole,
        *PLAIN_ROWS,
        SELECT_ROW,
    )


def variants(full: bool, scale: str = "full") -> tuple[Variant, ...]:
    """The surgery rows of one merge of `scale`: the headline, plus the ablations with `full`;
    the long scale's are its Table 10 grid (and with `full` the ablations it lacks)."""
    if scale != LONG:
        return VARIANTS if full else HEADLINE
    from demo.real_family import SCALES  # torch: only where the long rows are asked for

    grid = long_rows(SCALES[LONG].max_gen_toks)
    if not full:
        return grid
    return grid + tuple(v for v in ABLATIONS if v not in grid)


def fixed_variant(candidate: dict[str, Any], continuation_tokens: int) -> Variant:
    """The fixed variant a select candidate trains exactly like (same settings, same captures).

    The `none` candidate is no variant: it is the merge's own row.
    """
    if candidate["module"] == NO_CORRECTION["module"]:
        raise ValueError("the `none` candidate is the no-surgery row, not a variant")
    for variant in VARIANTS:
        settings = {**DARTS, **variant.overrides}
        same = all(settings.get(k) == candidate[k] for k in ("module", "loss"))
        if same and not variant.selects and variant.continuation_tokens == continuation_tokens:
            return variant
    raise ValueError(f"no fixed variant trains like {candidate}")


def joint_tasks(rows: tuple[Variant, ...]) -> list[str]:
    """The tasks the joint correction is fitted on and judged by: each domain's default
    (`_select`, on prompts), whose candidates include the plain kinds; none without it."""
    if SELECT_ROW not in rows:
        return []
    return [surgery_task(d) + SELECT_ROW.suffix for d in DOMAIN_NAMES]


def surgery_task(domain: str) -> str:
    """Surgery task name serving the lm-eval task `demo_<domain>` under `surgery=auto`."""
    return domain


def lm_eval_task(domain: str) -> str:
    return f"demo_{domain}"


def _rel(path: Path) -> str:
    return os.path.relpath(path)


def merge_config(
    method: str,
    base: Path,
    experts: dict[str, Path],
    calib_files: dict[str, Path],
    steps: int = 500,
    cache_dir: Path | None = None,
    rows: tuple[Variant, ...] = HEADLINE,
    background: Path | None = None,
    surgery_seed: int = 0,
) -> dict[str, Any]:
    """The full merge YAML (as a dict) of one method, surgery block included.

    A nonzero ``surgery_seed`` becomes the block's ``seed:`` (module init, batch order, select's
    held-out split and the router's fit); the merge itself does not depend on it.

    With ``cache_dir`` the four merges share one capture store: each expert is captured once for
    the whole demo, and a re-run (or ``examples/sweep.yml`` after it) loads no expert. With
    ``background`` (generic prompts, `prompt` field) the block routes over the DARTS tasks. With
    the `select` row among ``rows`` the block fits one joint plain correction over its tasks.
    """
    parameters, uses_base = METHODS[method]
    config: dict[str, Any] = {"merge_method": method}
    if uses_base:
        config["base_model"] = _rel(base)
    config["models"] = [
        {"model": _rel(experts[d]), "parameters": dict(parameters)} for d in DOMAIN_NAMES
    ]
    config["dtype"] = "float32"
    config["surgery"] = {"steps": steps}
    if surgery_seed:
        config["surgery"]["seed"] = surgery_seed
    if cache_dir is not None:
        config["surgery"]["cache_dir"] = _rel(cache_dir)
    if background is not None:
        config["surgery"]["route"] = {
            "tasks": [surgery_task(d) for d in DOMAIN_NAMES],
            "holdout": 0.2,
            "background": {
                "path": _rel(background),
                "field": "prompt",
                "num_samples": BACKGROUND_SAMPLES,
            },
        }
    if joint := joint_tasks(rows):
        config["surgery"]["joint"] = {"tasks": joint}
    config["surgery"]["tasks"] = _surgery_tasks(experts, calib_files, rows)
    return config


def _surgery_tasks(
    experts: dict[str, Path], calib_files: dict[str, Path], rows: tuple[Variant, ...]
) -> list[dict[str, Any]]:
    tasks = []
    for variant in rows:
        for domain in DOMAIN_NAMES:
            calibration: dict[str, Any] = {"path": _rel(calib_files[domain]), "field": "prompt"}
            if variant.continuation_tokens:
                calibration["continuation_tokens"] = variant.continuation_tokens
            tasks.append(
                {
                    "name": surgery_task(domain) + variant.suffix,
                    "target": _rel(experts[domain]),
                    # only DARTS answers `surgery=auto`; the others are chosen by surgery_map
                    "eval_tasks": [lm_eval_task(domain)] if variant.suffix == "" else [],
                    "calibration": calibration,
                    **copy.deepcopy(variant.overrides),  # no shared objects: no YAML aliases
                }
            )
    return tasks


def write_config(config: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
