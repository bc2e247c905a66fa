"""`select:` and `holdout:` in the surgery block: bad values are one line before any merge work."""

from __future__ import annotations

import pytest
from tiny import change_block, change_task, merge_config, quick_block, refuse

from mergekit_darts.config import parse_surgery, resolve_tasks

THREE = [
    {"module": "standard", "loss": "l1"},
    {"module": "pos_corr", "loss": "l1"},
    {"module": "pos_corr", "loss": "ewl1"},
]


def select(**changes) -> dict:
    return {"candidates": THREE, **changes}


TRAIN = {"split": "train", "indices": [0, 1]}
LM_EVAL = {"metric": "lm_eval", "dev": TRAIN}


BAD_SELECT = [
    (
        "empty candidates",
        change_block(select={"candidates": []}),
        "surgery.select.candidates: must not",
    ),
    (
        "unknown key in a candidate",
        change_block(select={"candidates": [{"modul": "standard"}]}),
        "surgery.select.candidates[0].modul: unknown key; allowed here: module, loss, rank",
    ),
    (
        "unknown module in a task's candidate",
        change_task(1, select={"candidates": [{"module": "lora"}]}),
        "surgery.tasks[1].select.candidates[0].module: 'lora' is not allowed",
    ),
    (
        "holdout of 1",
        change_block(select=select(holdout=1.0)),
        "surgery.select.holdout: must be < 1",
    ),
    ("holdout of 0", change_block(select=select(holdout=0)), "surgery.select.holdout: must be > 0"),
    ("task holdout above 1", change_task(0, holdout=1.5), "surgery.tasks[0].holdout: must be < 1"),
    (
        "unknown metric",
        change_block(select=select(metric="accuracy")),
        "surgery.select.metric: 'accuracy' is not allowed; choose one of agreement, kl, rho_l1, "
        "completion_match, completion_agreement, completion_rho_l1, completion_prefix or lm_eval",
    ),
    (
        "unknown select key",
        change_block(select=select(fold=5)),
        "surgery.select.fold: unknown key",
    ),
    (
        "holdout leaving no training prompt",
        change_task(0, holdout=0.5, calibration={"num_samples": 1}),
        "surgery.tasks[0].holdout: 0.5 of 1 prompt(s) holds out 1, leaving no prompt to train on",
    ),
    (
        "select holdout leaving no training prompt",
        change_task(1, select=select(holdout=0.9), calibration={"num_samples": 2}),
        "surgery.tasks[1].select.holdout: 0.9 of 2 prompt(s) holds out 2",
    ),
    (
        "holdout given twice on a task",
        change_task(0, holdout=0.1, select=select()),
        "surgery.tasks[0].holdout: surgery.tasks[0].select.holdout sets the held-out fraction",
    ),
    (
        "metric lm_eval without a dev split",
        change_task(0, eval_tasks=["gsm8k"], select={"metric": "lm_eval"}),
        "surgery.tasks[0].select.dev: metric lm_eval scores the candidates with lm-eval on a "
        "development split",
    ),
    (
        "a dev split without metric lm_eval",
        change_block(select=select(dev={"split": "train"})),
        "surgery.select.dev: a development split is read by metric lm_eval only (now "
        "completion_prefix); set metric: lm_eval or remove dev",
    ),
    (
        "dev indices and limit",
        change_task(0, eval_tasks=["gsm8k"], select=LM_EVAL | {"dev": TRAIN | {"limit": 2}}),
        "surgery.tasks[0].select.dev: indices and limit both choose the dev documents",
    ),
    (
        "dev with no indices",
        change_task(
            0, eval_tasks=["gsm8k"], select=LM_EVAL | {"dev": {"split": "train", "indices": []}}
        ),
        "surgery.tasks[0].select.dev.indices: must not",
    ),
    (
        "metric lm_eval with folds",
        change_task(0, eval_tasks=["gsm8k"], select=LM_EVAL | {"folds": 5}),
        "surgery.tasks[0].select.folds: with metric lm_eval the dev split judges",
    ),
    (
        "metric lm_eval with a task holdout",
        change_task(0, eval_tasks=["gsm8k"], holdout=0.2, select=LM_EVAL),
        "surgery.tasks[0].holdout: with metric lm_eval (surgery.tasks[0].select) the dev split",
    ),
    (
        "metric lm_eval on a task that names no lm-eval task",
        change_block(select=LM_EVAL),
        "surgery.tasks[0].eval_tasks: metric lm_eval (surgery.select) scores the candidates on "
        "the lm-eval tasks this module serves; list them",
    ),
    (
        "candidate position table shorter than max_length",
        change_block(select={"candidates": [{"loss": "l1"}, {"max_positions": 16}]}),
        "surgery.select.candidates[1]: surgery.tasks[0].calibration.max_length: 512 exceeds "
        "max_positions 16",
    ),
    (
        "candidate trains on completions that do not exist",
        change_task(0, select={"candidates": [{"loss_positions": "completion"}]}),
        "surgery.tasks[0].select.candidates[0]: surgery.tasks[0].loss_positions: `completion` needs",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"), [c[1:] for c in BAD_SELECT], ids=[c[0] for c in BAD_SELECT]
)
def test_bad_select_is_one_line_before_merging(
    tiny_family,
    calibration_data,
    odd,
    tmp_path,
    mutate,
    expected,
):
    config = merge_config(tiny_family, calibration_data)
    mutate(config, odd)
    message = refuse(config, tmp_path / "out")
    assert message.startswith(expected), message


@pytest.mark.parametrize("metric", ["agreement", "kl"])
def test_logit_metrics_refuse_a_target_with_appended_tokens(
    tiny_family,
    calibration_data,
    extended,
    tmp_path,
    metric,
):
    config = merge_config(tiny_family, calibration_data)
    config["surgery"]["tasks"] = config["surgery"]["tasks"][:1]
    config["surgery"]["tasks"][0]["target"] = str(extended / "math_plus")
    config["surgery"].update(target_vocab="prefix", select=select(metric=metric))
    message = refuse(config, tmp_path / "out")
    assert "vocab_size" in message and "select metric rho_l1" in message


def test_task_values_win_over_the_block_and_candidates_inherit_the_task():
    base = {"target": "t", "calibration": {"path": "p.jsonl"}}
    config = parse_surgery(
        {
            "loss": "l1",
            "select": select(holdout=0.25),
            "tasks": [
                {"name": "a", **base, "rank": 4},  # the block's select and its holdout
                {"name": "b", **base, "holdout": 0.1},  # the block's select, its own holdout
                {"name": "c", **base, "select": {"candidates": [{"lr": 0.01}], "metric": "kl"}},
            ],
        }
    )
    a, b, c = resolve_tasks(config)
    assert (a.holdout, a.holdout_key) == (0.25, "surgery.select.holdout")
    assert (b.holdout, b.holdout_key) == (0.1, "surgery.tasks[1].holdout")
    assert (c.holdout, c.folds) == (0, 5)  # its own select, no holdout: the default folds
    assert c.select.metric == "kl" and c.select_key == "surgery.tasks[2].select"
    assert [(x.module, x.loss, x.rank) for x in a.candidates()] == [
        ("none", "l1", 4),  # the verdict's baseline, always a candidate
        ("standard", "l1", 4),
        ("pos_corr", "l1", 4),
        ("pos_corr", "ewl1", 4),
    ]
    assert [(x.loss, x.lr) for x in c.candidates()] == [("l1", 0.01)]
    assert (
        not a.needs_logits  # the verdict compares top-1 tokens with the target's completions
        and resolve_tasks(
            parse_surgery({"select": select(metric="kl"), "tasks": [{"name": "x", **base}]})
        )[0].needs_logits
        and not resolve_tasks(
            parse_surgery({"select": select(metric="rho_l1"), "tasks": [{"name": "x", **base}]})
        )[0].needs_logits
    )


def test_block_with_holdout_and_select_is_refused():
    base = {"name": "a", "target": "t", "calibration": {"path": "p.jsonl"}}
    with pytest.raises(Exception, match="surgery.holdout: surgery.select.holdout sets"):
        parse_surgery({"holdout": 0.3, "select": select(), "tasks": [base]})


def test_plain_true_limits_the_default_candidates_to_plain_kinds(tiny_family, calibration_data):
    (task,) = resolve_tasks(parse_surgery(quick_block(tiny_family, calibration_data, plain=True)))
    assert [c.module for c in task.select.candidates] == ["none", "head", "norm"]
    assert task.select_default


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"module": "pos_corr"}, "surgery.module"),
        ({"select": {"candidates": [{"module": "head"}, {"module": "standard"}]}},
         "surgery.select.candidates[1].module"),
    ],
)  # fmt: skip
def test_plain_true_refuses_a_module_that_does_not_fold(
    tiny_family, calibration_data, settings, key
):
    from mergekit_darts.errors import SurgeryConfigError

    block = quick_block(tiny_family, calibration_data, plain=True, **settings)
    with pytest.raises(SurgeryConfigError) as err:
        parse_surgery(block)
    message = str(err.value)
    assert message.startswith(f"{key}: ") and "plain: true" in message and "\n" not in message
