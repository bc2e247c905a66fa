"""Cross-fitted selection (`select: {folds: K}`): every calibration prompt judged once, by the
modules that did not train on it, with the graded completion outcome (calibrate.verdict)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from tiny import quick_block
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import run_surgery
from mergekit_darts.calibrate.selection import fold_split
from mergekit_darts.config import parse_surgery, resolve_tasks
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.folder.manifest import Manifest
from mergekit_darts.present.summary import print_summary

TOKENS = 6  # completion tokens: enough for the reproduced prefix to take several values
FOLDS = 3


@pytest.fixture(scope="module")
def crossfit_run(tiny_family, calibration_data, tiny_merged, tmp_path_factory):
    """pos_corr + L1 against none, cross-fitted over 3 folds of the 12 prompts; alpha loose so
    that the refit of a correction, not the identity, is what gets saved."""
    merged = Path(shutil.copytree(tiny_merged, tmp_path_factory.mktemp("crossfit") / "merged"))
    select = {
        "candidates": [{"module": "pos_corr", "loss": "l1"}],
        "folds": FOLDS,
        "metric": "completion_prefix",
        "completion_tokens": TOKENS,
        "alpha": 0.6,
    }
    block = quick_block(tiny_family, calibration_data, select=select)
    return merged, block, run_surgery(merged, block, progress=False)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _greedy(model, ids: list[int], eos: int) -> list[int]:
    """Greedy tokens after an unpadded prompt, up to TOKENS, through the first end of sequence."""
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=TOKENS,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos,
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    return out[: out.index(eos) + 1] if eos in out else out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_fold_split_covers_every_row_once_in_near_equal_folds():
    folds = fold_split(12, 5, seed=3)
    rows = torch.cat(folds).tolist()
    assert sorted(rows) == list(range(12)) and [len(f) for f in folds] == [3, 3, 2, 2, 2]
    assert all(f.tolist() == sorted(f.tolist()) for f in folds)
    assert [f.tolist() for f in fold_split(12, 5, seed=3)] == [f.tolist() for f in folds]
    assert [f.tolist() for f in fold_split(12, 5, seed=4)] != [f.tolist() for f in folds]


@pytest.mark.parametrize(
    ("select", "task", "message"),
    [
        ({"folds": 3, "holdout": 0.2}, {}, "surgery.select: holdout and folds both say"),
        ({"folds": 3, "refit": False}, {}, "surgery.select.refit: false keeps the module"),
        ({"folds": 3}, {"holdout": 0.3}, "surgery.tasks[0].holdout: surgery.select.folds"),
        ({"folds": 1}, {}, "surgery.select.folds"),
    ],
)
def test_folds_that_cannot_work_are_one_line_errors(
    tiny_family, calibration_data, select, task, message
):
    block = quick_block(tiny_family, calibration_data, select=select)
    block["tasks"][0].update(task)
    with pytest.raises(SurgeryConfigError) as err:
        resolve_tasks(parse_surgery(block))
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.slow
def test_more_folds_than_prompts_stop_before_any_model_loads(
    tiny_family, calibration_data, merged_copy
):
    block = quick_block(tiny_family, calibration_data, select={"folds": 13})
    with pytest.raises(SurgeryConfigError) as err:
        run_surgery(merged_copy, block, progress=False)
    assert str(err.value) == (
        "surgery.select.folds: 13 folds need at least 13 calibration prompts, and task 'math' "
        "has 12; lower folds or give more prompts"
    )
    assert not (merged_copy / "surgery").exists()


@pytest.mark.slow
def test_every_prompt_is_judged_once(crossfit_run, tiny_family):
    _, _, manifest = crossfit_run
    selection = manifest["tasks"]["math"]["selection"]
    assert selection["folds"] == FOLDS and "holdout_sha256" not in selection
    judged = [sha for fold in selection["fold_sha256"] for sha in fold]
    assert sorted(judged) == sorted(_sha(p) for p in tiny_family.prompts)
    assert [len(f) for f in selection["fold_sha256"]] == [4, 4, 4]
    for candidate in selection["candidates"]:
        assert all(len(v) == 12 for v in candidate["verdict"].values())
        assert len(candidate["final_loss"]) == FOLDS or candidate["module"] == "none"
    assert selection["test"].startswith("one-sided exact Wilcoxon signed-rank")
    assert selection["detectable"]["prompts"] == 12
    assert "held_out" not in manifest["tasks"]["math"]  # no share was held out
    # the heads were captured: every candidate's agreement and KL over its judged tokens
    assert all(c["held_out"]["agreement"] is not None for c in selection["candidates"])


@pytest.mark.slow
def test_the_graded_outcome_is_the_prefix_greedy_generation_reproduces(crossfit_run, tiny_family):
    merged, _, manifest = crossfit_run
    none = manifest["tasks"]["math"]["selection"]["candidates"][0]
    assert none["module"] == "none"
    tokenizer = AutoTokenizer.from_pretrained(merged)
    prompts = [tokenizer(p)["input_ids"][:24] for p in tiny_family.prompts]
    target = AutoModelForCausalLM.from_pretrained(tiny_family.math, dtype=torch.float64).eval()
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float64).eval()
    eos = model.config.eos_token_id
    expected = [
        float(_common_prefix(_greedy(model, ids, eos), _greedy(target, ids, eos)))
        for ids in prompts
    ]
    assert none["verdict"]["completion_prefix"] == expected
    assert len(set(expected)) > 1  # the outcome is graded here, not 0/1
    matches = [
        float(e == len(_greedy(target, ids, eos))) for e, ids in zip(expected, prompts, strict=True)
    ]
    assert none["verdict"]["completion_match"] == matches


@pytest.mark.slow
def test_the_kept_settings_are_refit_on_every_prompt(
    crossfit_run, tiny_family, calibration_data, tiny_merged, tmp_path
):
    merged, block, manifest = crossfit_run
    selection = manifest["tasks"]["math"]["selection"]
    assert selection["chosen"] == 1, selection["verdict"]  # alpha 0.6: the correction passes
    fixed = json.loads(json.dumps(block))
    fixed.pop("select")
    fixed.update(module="pos_corr", loss="l1")
    other = Path(shutil.copytree(tiny_merged, tmp_path / "fixed"))
    run_surgery(other, fixed, progress=False)
    a = (merged / "surgery" / "math.safetensors").read_bytes()
    assert a == (other / "surgery" / "math.safetensors").read_bytes()
    line = selection["verdict"]
    assert line.startswith("kept pos_corr + l1: held-out reproduced completion tokens ")
    assert "with 12 prompts the test detects a mean gain of >= " in line
    assert f"math: {line}" in (merged / "README.md").read_text()


@pytest.mark.slow
def test_card_and_summary_show_the_cross_fitted_selection(crossfit_run, capsys):
    merged, _, manifest = crossfit_run
    card = (merged / "README.md").read_text()
    assert "### Held-out measurement and selection" in card
    assert "A task with `select` trained each candidate on the other prompts" in card
    assert "with `folds`: every prompt, by the modules that did not train on it" in card
    assert "✓ by completion_prefix" in card
    print_summary(Manifest.model_validate(manifest), Console(width=400))
    out = capsys.readouterr().out
    assert f"math: {manifest['tasks']['math']['selection']['verdict']}" in out
