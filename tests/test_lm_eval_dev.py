"""``select: {metric: lm_eval, dev: ...}``: candidates scored by the real lm-eval on a dev split.

The tasks are the local ``lm_eval_tasks/darts_tiny_dev*.yaml`` (a train and a test split each;
lm-eval evaluates test, the train split judges). Refusals go through the hook's merge path and
must come before any merge work, leaving the output folder as it was.
"""

from __future__ import annotations

import contextlib
import gc
import random
import shutil
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tiny
import torch
import yaml
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from tiny import PROMPTS, change_task, merge, merge_config, refuse, surgery_block

from lm_eval_darts.model import DartsHFLM
from mergekit_darts import run_surgery
from mergekit_darts.calibrate.dev import DevJudge, per_document
from mergekit_darts.calibrate.runtime import Runtime, merged_tokenizer
from mergekit_darts.calibrate.store import StoreStats
from mergekit_darts.calibrate.verdict import DEV_TEST, Wording, decide, signed_rank_test
from mergekit_darts.config import parse_surgery, resolve_tasks
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.hosts.lm_eval_dev import LmEvalDev

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
DEV, DEV_GEN = "darts_tiny_dev", "darts_tiny_dev_gen"
DEV_COT = "darts_tiny_dev_cot"  # DEV's data files under another template (gsm8k_cot to gsm8k)
LIMIT = 10  # train documents 10 and 11 may not judge (see darts_tiny_dev.yaml)


def lm_eval_select(**dev: Any) -> dict[str, Any]:
    return {"metric": "lm_eval", "dev": {"include_path": str(TASKS_DIR), **dev}}


@pytest.fixture(scope="module")
def dev_run(tiny_family, calibration_data, tiny_merged, tmp_path_factory) -> tuple[Path, dict]:
    merged = Path(shutil.copytree(tiny_merged, tmp_path_factory.mktemp("dev") / "merged"))
    block = surgery_block(
        tiny_family.code,  # farther from this merge than math: its corrections change outcomes
        calibration_data / "math.jsonl",
        calibration={"num_samples": 8, "max_length": 16},
        task={"eval_tasks": [DEV, DEV_GEN], "select": lm_eval_select(split="train", limit=LIMIT)},
        steps=100,
        lr=3e-2,
        batch_size=4,
        max_positions=16,
    )
    with contextlib.chdir(TASKS_DIR):  # the task YAMLs name their data relative to it
        manifest = run_surgery(merged, block)  # the printed summary and the card too
    return merged, manifest


def independent_outcomes(model: Any, documents: dict[str, int]) -> list[float]:
    """Per document, the first metric of lm-eval's ``model`` (an LM, or a merged folder for
    stock ``hf``) on the first ``documents[task]`` documents of each task's train split,
    evaluated through an inline config of the task's own YAML (test_split: train)."""
    tasks, metrics = [], {}
    for name in documents:
        config = yaml.safe_load((TASKS_DIR / f"{name}.yaml").read_text())
        if "include" in config:  # a task written as another's YAML with a few keys changed
            config = {**yaml.safe_load((TASKS_DIR / config.pop("include")).read_text()), **config}
        tasks.append({**config, "test_split": "train"})
        metrics[name] = config["metric_list"][0]["metric"]
    with contextlib.chdir(TASKS_DIR):
        out = simple_evaluate(
            model="hf" if isinstance(model, Path) else model,
            model_args={"pretrained": str(model), "device": "cpu"},
            tasks=tasks,
            samples={name: list(range(n)) for name, n in documents.items()},
            batch_size=4,
            bootstrap_iters=0,
            log_samples=True,
            task_manager=TaskManager(include_defaults=False),
        )
    values = []
    for name, n in documents.items():
        by_doc = {s["doc_id"]: s for s in out["samples"][name]}
        values += [float(by_doc[i][metrics[name]]) for i in range(n)]
    return values


@pytest.mark.slow
def test_every_candidate_is_scored_per_item_and_none_is_stock_lm_eval(dev_run):
    merged, manifest = dev_run
    selection = manifest["tasks"]["math"]["selection"]
    assert selection["metric"] == "lm_eval" and selection["test"] == DEV_TEST
    gen_docs = len((TASKS_DIR / "darts_tiny_dev_gen_train.jsonl").read_text().splitlines())
    items = [f"{DEV}/{i}" for i in range(LIMIT)] + [f"{DEV_GEN}/{i}" for i in range(gen_docs)]
    assert selection["dev"]["items"] == items
    assert selection["dev"]["split"] == "train"
    assert selection["dev"]["tasks"][DEV] == {
        "metric": "acc",
        "filter": "none",
        "evaluated_split": "test",
        "documents": LIMIT,
    }
    candidates = selection["candidates"]
    assert [c["module"] for c in candidates] == [
        "none",
        "standard",
        "pos_corr",
        "pos_corr",
        "head",
        "norm",
    ]
    none = candidates[0]["verdict"]["lm_eval"]
    for candidate in candidates:
        outcomes = candidate["verdict"]["lm_eval"]
        assert len(outcomes) == len(items) and set(outcomes) <= {0.0, 1.0}
        assert candidate["held_out"]["lm_eval"] == pytest.approx(sum(outcomes) / len(items))
    assert any(c["verdict"]["lm_eval"] != none for c in candidates[1:])  # discordant items
    for candidate in candidates[1:]:  # McNemar: the exact sign test on the discordant items
        test = candidate["test"]
        outcomes = candidate["verdict"]["lm_eval"]
        better = sum(a > b for a, b in zip(outcomes, none, strict=True))
        worse = sum(a < b for a, b in zip(outcomes, none, strict=True))
        assert (test["better"], test["worse"], test["prompts"]) == (better, worse, len(items))
        tail = sum(_binomial(better + worse, k) for k in range(better, better + worse + 1))
        assert test["p"] == pytest.approx(tail / 2 ** (better + worse) if better + worse else 1.0)
        assert test["p"] == signed_rank_test(outcomes, none)["p"]
    assert none == independent_outcomes(merged, {DEV: LIMIT, DEV_GEN: gen_docs})
    line = selection["verdict"]
    assert line.startswith(("kept ", "kept no correction")) and "McNemar p = " in line
    assert manifest["tasks"]["math"]["module"] == candidates[selection["chosen"]]["module"]


def _binomial(n: int, k: int) -> int:
    from math import comb

    return comb(n, k)


def dev_scorer(merged: Path, eval_tasks: list[str]) -> tuple[LmEvalDev, DevJudge]:
    """The checked dev documents of one task judged on ``eval_tasks``, and a judge on ``merged``."""
    block = {
        "device": "cpu",
        "select": lm_eval_select(split="train", limit=LIMIT),
        "tasks": [
            {
                "name": "math",
                "target": "t",
                "eval_tasks": eval_tasks,
                "calibration": {"path": "unused.jsonl"},  # no prompt: nothing to overlap
            }
        ],
    }
    config = parse_surgery(block)
    (task,) = resolve_tasks(config)
    tokenizer = merged_tokenizer(str(merged), False)
    with contextlib.chdir(TASKS_DIR):
        scorer = LmEvalDev.check(task, [], tokenizer)
    runtime = Runtime.of(config, tokenizer, False)
    return scorer, DevJudge(str(merged), runtime, {"math": scorer}, StoreStats())


@pytest.mark.slow
def test_a_candidate_is_scored_with_its_module_applied_as_hf_darts_applies_it(
    tiny_merged, tmp_path
):
    """A random module strong enough to change outcomes: the judge's scores with it equal
    ``hf-darts`` with the same module written to a surgery folder, and differ from none."""
    merged = Path(shutil.copytree(tiny_merged, tmp_path / "merged"))
    module = tiny.random_module("pos_corr", 64, 4, 16, seed=3, scale=1.0)
    _, judge = dev_scorer(merged, [DEV, DEV_GEN])
    generators = random.getstate(), torch.random.get_rng_state()
    try:
        none = judge.outcomes("math", None, 4, {})
        corrected = judge.outcomes("math", module, 4, {})
        loaded = weakref.ref(judge._model.get("math", {}, "unused"))  # the one it scored
    finally:
        judge.close()
    gc.collect()
    assert loaded() is None  # closed: nothing (lm-eval's HFLM included) holds the model
    # lm-eval seeds the global generators; the caller's state comes back
    assert random.getstate() == generators[0]
    assert torch.equal(torch.random.get_rng_state(), generators[1])
    documents = {DEV: LIMIT, DEV_GEN: len(corrected.values) - LIMIT}
    tiny.write_surgery(merged / "surgery", {"math": module})
    darts = DartsHFLM(pretrained=str(merged), surgery="math", device="cpu", batch_size=4)
    assert corrected.values == independent_outcomes(darts, documents)
    assert none.values == independent_outcomes(merged, documents)
    assert corrected.values != none.values  # the module was applied: this test can fail


def test_a_document_two_tasks_read_is_one_paired_item(tiny_merged):
    """darts_tiny_dev and darts_tiny_dev_cot read the same train file, as gsm8k and gsm8k_cot
    read gsm8k's: each judged document is one item, its outcome the mean of the two tasks'
    outcomes on it, and the test pairs as many items as there are documents."""
    scorer, judge = dev_scorer(tiny_merged, [DEV, DEV_COT])
    module = tiny.random_module("pos_corr", 64, 4, 16, seed=3, scale=1.0)
    try:
        none = judge.outcomes("math", None, 4, {})
        corrected = judge.outcomes("math", module, 4, {})
    finally:
        judge.close()
    assert none.items == corrected.items == [f"{DEV}/{i}+{DEV_COT}/{i}" for i in range(LIMIT)]
    assert signed_rank_test(corrected.values, none.values)["prompts"] == LIMIT
    assert scorer.description == (
        f"the {LIMIT} train documents of {DEV}, {DEV_COT} (read {2 * LIMIT} times: each "
        "document one item, the mean of its outcomes)"
    )
    per_task = independent_outcomes(tiny_merged, {DEV: LIMIT, DEV_COT: LIMIT})
    assert none.values == [
        (a + b) / 2 for a, b in zip(per_task[:LIMIT], per_task[LIMIT:], strict=True)
    ]
    assert per_task[:LIMIT] != per_task[LIMIT:]  # the templates differ: the mean is a real one
    assert corrected.values != none.values


def test_readings_of_one_document_pool_into_one_item_in_first_reading_order():
    readings = [("a/0", "x", 1.0), ("b/0", "y", 0.0), ("b/1", "x", 0.0), ("a/1", "z", 1.0)]
    pooled = per_document(readings)
    assert pooled.items == ["a/0+b/1", "b/0", "a/1"]
    assert pooled.values == [0.5, 0.0, 1.0]


def _kept_under_the_null(trials: int, pooled: bool, seed: int) -> float:
    """How often ``decide`` keeps a correction no better than none, on 12 dev documents that two
    tasks both read (24 readings).

    Per document each model has an ability, drawn alike for both (the null: the correction
    is no better), that decides its outcome on both tasks up to a little noise of each task's
    own, as one model tends to get a gsm8k question right or wrong under either template.
    ``pooled``: one item per document (:func:`per_document`); else each reading an item.
    """
    rng = np.random.default_rng(seed)
    documents, tasks = 12, 2
    kept = 0
    for _ in range(trials):
        ability = rng.standard_normal((2, documents, 1))
        outcome = ability + 0.3 * rng.standard_normal((2, documents, tasks)) > 0
        entries = []
        for module, rows in zip(("none", "pos_corr"), outcome.astype(float), strict=True):
            readings = [
                (f"t{t}/{d}", str(d), float(rows[d, t]))
                for t in range(tasks)
                for d in range(documents)
            ]
            values = per_document(readings).values if pooled else [v for *_, v in readings]
            entries.append(
                {
                    "module": module,
                    "loss": None,
                    "verdict": {"lm_eval": values},
                    "held_out": {"lm_eval": float(np.mean(values))},
                }
            )
        wording = Wording("acc", "dev", "items", "the 12 train documents")
        kept += decide(entries, ["none", "pos_corr"], "lm_eval", 0.05, wording).chosen != 0
    return kept / trials


def test_with_shared_documents_a_correction_is_kept_at_most_alpha_of_the_time():
    # 4000 trials: the binomial standard error at 0.05 is 0.0034
    bound = 0.05 + 3 * (0.05 * 0.95 / 4000) ** 0.5
    assert _kept_under_the_null(4000, pooled=True, seed=0) <= bound
    # each document counted once per task: dependent items, kept more often than alpha
    assert _kept_under_the_null(4000, pooled=False, seed=0) > bound


@pytest.mark.slow
def test_the_merged_model_is_loaded_once_for_every_candidate(dev_run):
    _, manifest = dev_run
    # the target and the merged model for the captures, the merged model once more for lm-eval
    assert manifest["captures"]["model_loads"] == 3
    assert manifest["tasks"]["math"]["timings"]["load_dev_model_s"] > 0


REFUSED = [
    (
        "dev is the evaluated split",
        {"split": "test"},
        [DEV],
        "surgery.tasks[0].select.dev.split: 'test' is the split lm-eval evaluates "
        "'darts_tiny_dev' on",
    ),
    (
        "no such split",
        {"split": "validation"},
        [DEV],
        "surgery.tasks[0].select.dev.split: lm-eval task 'darts_tiny_dev' has no split "
        "'validation' (it has train, test)",
    ),
    (
        "a task without a train split",
        {"split": "train"},
        ["darts_tiny_mc"],
        "surgery.tasks[0].select.dev.split: lm-eval task 'darts_tiny_mc' has no split 'train'",
    ),
    (
        "a dev document that is evaluated",
        {"split": "train", "indices": [3, 10]},
        [DEV],
        "surgery.tasks[0].select.dev: document 10 of 'darts_tiny_dev''s train split ('question : "
        "eight minus one is') is evaluation document 0 of its test split",
    ),
    (
        "a dev document holding a calibration prompt",
        {"split": "train", "indices": [11]},
        [DEV],
        "surgery.tasks[0].select.dev: document 11 of 'darts_tiny_dev''s train split ('question : "
        "two plus three is') contains calibration prompt 0 of task 'math' (13-token overlap)",
    ),
    (
        "an index past the end",
        {"split": "train", "indices": [12]},
        [DEV],
        "surgery.tasks[0].select.dev.indices: document 12 is past the end of 'darts_tiny_dev''s "
        "train split (12 documents",
    ),
]


@pytest.mark.parametrize(
    ("dev", "eval_tasks", "expected"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_bad_dev_split_is_refused_before_merging(
    tiny_family, calibration_data, odd, tmp_path, dev, eval_tasks, expected
):
    assert PROMPTS[0] == "question : two plus three is"  # what train document 11 holds
    config = merge_config(tiny_family, calibration_data)
    change_task(0, eval_tasks=eval_tasks, select=lm_eval_select(**dev))(config, odd)
    with contextlib.chdir(TASKS_DIR):
        message = refuse(config, tmp_path / "out")
    assert message.startswith(expected), message


def lm_eval_merge_config(tiny_family, calibration_data, dev: dict[str, Any]) -> dict[str, Any]:
    """The tiny merge YAML with one task, math, selected by lm-eval on ``dev``."""
    config = merge_config(tiny_family, calibration_data)
    config["surgery"]["tasks"] = config["surgery"]["tasks"][:1]
    config["surgery"]["tasks"][0].update(eval_tasks=[DEV], select=lm_eval_select(**dev))
    return config


@pytest.mark.slow
def test_the_hooked_merge_checks_before_merging_and_scores_after(
    tiny_family, calibration_data, tmp_path
):
    """mergekit-yaml's path: the dev documents are checked against the base model's tokenizer
    before the merge and scored on the merged model after it."""
    config = lm_eval_merge_config(tiny_family, calibration_data, {"split": "train", "limit": LIMIT})
    with contextlib.chdir(TASKS_DIR):
        manifest = merge(config, tmp_path / "out")
    selection = manifest["tasks"]["math"]["selection"]
    assert selection["dev"]["items"] == [f"{DEV}/{i}" for i in range(LIMIT)]
    none = selection["candidates"][0]
    assert none["module"] == "none"
    assert none["verdict"]["lm_eval"] == independent_outcomes(tmp_path / "out", {DEV: LIMIT})


def test_run_surgery_refuses_before_touching_the_merged_folder(
    tiny_family, calibration_data, merged_copy
):
    before = {p: p.read_bytes() for p in merged_copy.rglob("*") if p.is_file()}
    block = lm_eval_merge_config(tiny_family, calibration_data, {"split": "test"})["surgery"]
    with contextlib.chdir(TASKS_DIR), pytest.raises(SurgeryConfigError) as refused:
        run_surgery(merged_copy, block, progress=False)
    assert "\n" not in str(refused.value) and "is the split lm-eval evaluates" in str(refused.value)
    assert {p: p.read_bytes() for p in merged_copy.rglob("*") if p.is_file()} == before
