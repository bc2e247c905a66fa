"""The held-out verdict (calibrate.verdict): the default selection, checked against real greedy
generation and float64 references on the tiny family."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from scipy.stats import binomtest
from tiny import surgery_block, surgery_task
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import apply_surgery, run_surgery
from mergekit_darts.calibrate.verdict import completion_reference, decide, sign_test
from mergekit_darts.config import parse_surgery, resolve_tasks
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.integrations.card import print_summary
from mergekit_darts.manifest import Manifest

TOKENS = 3  # completion tokens: short, so that some held-out prompts match and some do not


def _task(tiny_family, calibration_data, **settings) -> dict:
    return surgery_task(
        "math",
        tiny_family.math,
        calibration_data / "math.jsonl",
        calibration={"max_length": 24},
        **settings,
    )


def _block(tiny_family, calibration_data, **settings) -> dict:
    return surgery_block(
        tiny_family.math,
        calibration_data / "math.jsonl",
        calibration={"max_length": 24},
        steps=15,
        batch_size=4,
        max_positions=64,
        cache_dtype="float32",
        **settings,
    )


@pytest.fixture(scope="module")
def verdict_run(tiny_family, calibration_data, tiny_merged, tmp_path_factory):
    """pos_corr + L1 against none on 3-token completions, the measured module saved. alpha is
    loose (one better prompt of 6 passes) so that a correction, not the identity, is kept."""
    merged = Path(shutil.copytree(tiny_merged, tmp_path_factory.mktemp("verdict") / "merged"))
    select = {
        "candidates": [{"module": "pos_corr", "loss": "l1"}],
        "completion_tokens": TOKENS,
        "holdout": 0.5,
        "alpha": 0.6,
        "refit": False,
    }
    block = _block(tiny_family, calibration_data, select=select)
    return merged, run_surgery(merged, block, progress=False)


# ---- the sign test and the decision -------------------------------------------------------------


@pytest.mark.parametrize(
    ("candidate", "none"),
    [
        ([1, 1, 1, 1, 1], [0, 0, 0, 0, 0]),
        ([1, 1, 0, 1, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]),
        ([0.5, 0.2, 0.9, None, 0.4], [0.5, 0.3, 0.1, 0.7, 0.2]),
        ([0, 0, 0], [0, 0, 0]),
    ],
)
def test_sign_test_is_the_one_sided_binomial_test(candidate, none):
    result = sign_test(candidate, none)
    pairs = [
        (a, b) for a, b in zip(candidate, none, strict=True) if a is not None and b is not None
    ]
    better = sum(a > b for a, b in pairs)
    n = sum(a != b for a, b in pairs)
    assert (result["better"], result["worse"], result["prompts"]) == (
        better,
        n - better,
        len(pairs),
    )
    expected = binomtest(better, n, 0.5, alternative="greater").pvalue if n else 1.0
    assert result["p"] == pytest.approx(expected, rel=1e-12)


def _entry(module: str, loss: str | None, match: list[float]) -> dict:
    return {
        "module": module,
        "loss": loss,
        "verdict": {"completion_match": match},
        "held_out": {"completion_match": sum(match) / len(match)},
    }


def test_few_held_out_prompts_keep_the_merge_even_when_every_one_improves():
    # 4 prompts, all better: p = 1/16 > 0.05 / 1; the merge stays as it is
    entries = [_entry("none", None, [0, 0, 0, 0]), _entry("pos_corr", "l1", [1, 1, 1, 1])]
    chosen, line = decide(entries, ["none", "pos_corr + l1"], "completion_match", 0.05)
    assert chosen == 0
    assert line.startswith("kept no correction: no candidate beat the merge by the sign test")
    assert "better on 4, worse on 0 of 4 prompts, sign test p = 0.0625 > 0.05" in line


def test_a_clear_winner_is_kept_and_bonferroni_counts_every_correction():
    none = [0] * 10
    winner = [1] * 9 + [0]  # 9 better of 9: p = 1/512
    loser = [0] * 10
    entries = [
        _entry("none", None, none),
        _entry("standard", "l1", loser),
        _entry("pos_corr", "l1", winner),
        {**_entry("pos_corr", "ewl1", loser), "diverged": "loss is NaN"},
    ]
    labels = ["none", "standard + l1", "pos_corr + l1", "pos_corr + ewl1"]
    chosen, line = decide(entries, labels, "completion_match", 0.05)
    assert chosen == 2
    # two corrections measured (the diverged one is not), so each is tested at 0.025
    assert entries[2]["test"]["level"] == pytest.approx(0.025)
    assert "test" not in entries[3]
    assert line == (
        "kept pos_corr + l1: held-out completion match 0.9, none 0 (better on 9, worse on 0 of "
        "10 prompts, sign test p = 0.00195 <= 0.025)"
    )


def test_every_candidate_below_the_merge_says_so():
    entries = [_entry("none", None, [1, 1, 0]), _entry("standard", "l1", [0, 1, 0])]
    chosen, line = decide(entries, ["none", "standard + l1"], "completion_match", 0.05)
    assert chosen == 0
    assert line.startswith(
        "kept no correction: every candidate scored below the merge on held-out completions"
    )


def test_completion_reference_marks_the_positions_that_decide_the_completion():
    # prompt of 3 tokens, completion of 2 that ended (max 4): positions 2, 3 predict the
    # completion, position 4 its end; a completion cut at the maximum has no end position
    reference, predicting = completion_reference([[5, 6, 7], [5, 6]], [[8, 9], [8, 9, 10, 11]], 4)
    assert predicting.tolist() == [
        [False, False, True, True, True, False],
        [False, True, True, True, True, False],
    ]
    assert reference[0, 2:5].tolist() == [8, 9, -1]
    assert reference[1, 1:5].tolist() == [8, 9, 10, 11]


# ---- config: the default, `select: off`, an explicit module ------------------------------------


def test_a_block_without_module_loss_or_select_runs_the_default_selection(
    tiny_family, calibration_data
):
    block = {"tasks": [_task(tiny_family, calibration_data)]}
    (task,) = resolve_tasks(parse_surgery(block))
    assert task.select_default and task.verdict
    assert task.select.metric == "completion_match" and task.holdout == 0.2
    assert [(c.module, c.loss) for c in task.candidates()] == [
        ("none", "ewl1"),
        ("standard", "l1"),
        ("pos_corr", "l1"),
        ("pos_corr", "ewl1"),
    ]


@pytest.mark.parametrize(
    "where",
    [
        {"select": "off"},
        {"select": False},
        {"module": "pos_corr"},
        {"loss": "ewl1"},
    ],
)
def test_the_papers_recipe_is_one_key_away(tiny_family, calibration_data, where):
    for block in (
        {"tasks": [_task(tiny_family, calibration_data)], **where},
        {"tasks": [_task(tiny_family, calibration_data, **where)]},
    ):
        (task,) = resolve_tasks(parse_surgery(block))
        assert task.select is None and task.holdout == 0
        assert (task.module, task.loss) == ("pos_corr", "ewl1")


def test_a_verdict_metric_always_has_none_among_the_candidates(tiny_family, calibration_data):
    select = {"candidates": [{"module": "standard", "loss": "l1"}]}
    (task,) = resolve_tasks(
        parse_surgery({"tasks": [_task(tiny_family, calibration_data)], "select": select})
    )
    assert [c.module for c in task.candidates()] == ["none", "standard"]
    select["metric"] = "agreement"  # the older metrics rank only what they are given
    (task,) = resolve_tasks(
        parse_surgery({"tasks": [_task(tiny_family, calibration_data)], "select": select})
    )
    assert [c.module for c in task.candidates()] == ["standard"]


@pytest.mark.parametrize(
    ("select", "message"),
    [
        ({"alpha": 0}, "surgery.select.alpha"),
        ({"alpha": 1.5}, "surgery.select.alpha"),
        ({"completion_tokens": 0}, "surgery.select.completion_tokens"),
        ({"metric": "completion"}, "surgery.select.metric"),
        (True, "surgery.select: expected a mapping of select settings, or off"),
        ("on", "surgery.select: expected a mapping of select settings, or off"),
    ],
)
def test_bad_verdict_settings_are_one_line_errors(tiny_family, calibration_data, select, message):
    block = {"tasks": [_task(tiny_family, calibration_data)], "select": select}
    with pytest.raises(SurgeryConfigError) as err:
        parse_surgery(block)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_default_selection_with_one_prompt_says_how_to_leave_it(
    tiny_family, calibration_data, tiny_merged, tmp_path
):
    one = tmp_path / "one.jsonl"
    one.write_text('{"question": "def add ( x , y ) : return"}\n')
    task = _task(tiny_family, calibration_data)
    task["calibration"] = {**task["calibration"], "path": str(one)}
    merged = Path(shutil.copytree(tiny_merged, tmp_path / "out"))
    with pytest.raises(SurgeryConfigError) as err:
        run_surgery(merged, {"tasks": [task]}, progress=False)
    message = str(err.value)
    assert message.startswith("surgery.select.holdout: 0.2 of 1 prompt(s) holds out 1")
    assert "`select: off` trains one module on every prompt" in message and "\n" not in message
    assert not (merged / "surgery").exists()


# ---- the numbers, against real generation and a float64 forward pass -----------------------------


def _held_out_prompts(tiny_family, entry) -> list[str]:
    by_sha = {hashlib.sha256(p.encode()).hexdigest(): p for p in tiny_family.prompts}
    return [by_sha[s] for s in entry["selection"]["holdout_sha256"]]


def _greedy(model, ids: list[int]) -> list[int]:
    """The greedy continuation of one unpadded prompt, cut before the first end of sequence."""
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=TOKENS,
        do_sample=False,
        num_beams=1,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=0,
    )[0, len(ids) :].tolist()
    return out[: out.index(model.config.eos_token_id)] if model.config.eos_token_id in out else out


def _teacher_forced_agreement(model, ids: list[int], completion: list[int]) -> float:
    """float64: the share of predicting positions where the model's top-1 is the completion's
    next token (at the end: the end-of-sequence token)."""
    sequence = torch.tensor([ids + completion])
    with torch.no_grad():
        mine = model(sequence).logits[0].argmax(-1)
    start, end = len(ids) - 1, len(ids) - 1 + len(completion) + (len(completion) < TOKENS)
    wanted = torch.tensor(completion + [model.config.eos_token_id])[: end - start]
    return float((mine[start:end] == wanted).double().mean())


@pytest.mark.slow
def test_teacher_forced_match_is_greedy_generation_with_the_saved_module(verdict_run, tiny_family):
    merged, manifest = verdict_run
    entry = manifest["tasks"]["math"]
    selection = entry["selection"]
    candidates = selection["candidates"]
    assert [c["module"] for c in candidates][0] == "none"
    tokenizer = AutoTokenizer.from_pretrained(merged)
    prompts = [tokenizer(p)["input_ids"][:24] for p in _held_out_prompts(tiny_family, entry)]
    target = AutoModelForCausalLM.from_pretrained(tiny_family.math, dtype=torch.float64).eval()
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float64).eval()
    wanted = [_greedy(target, ids) for ids in prompts]
    none = candidates[0]["verdict"]
    assert none["completion_match"] == [
        float(_greedy(model, ids) == w) for ids, w in zip(prompts, wanted, strict=True)
    ]
    assert none["completion_agreement"] == pytest.approx(
        [_teacher_forced_agreement(model, ids, w) for ids, w in zip(prompts, wanted, strict=True)]
    )
    assert none["completion_rho_l1"] == [0.0] * len(prompts)
    assert [c["module"] for c in candidates] == ["none", "pos_corr"]
    assert selection["chosen"] == 1  # a real module: both outcomes of the match occur below
    chosen = candidates[1]["verdict"]
    handle = apply_surgery(model, merged / "surgery", task="math")  # refit off: the measured one
    try:
        matches = [float(_greedy(model, ids) == w) for ids, w in zip(prompts, wanted, strict=True)]
        agreement = [
            _teacher_forced_agreement(model, ids, w) for ids, w in zip(prompts, wanted, strict=True)
        ]
    finally:
        handle.remove()
    assert chosen["completion_match"] == matches and 0 < sum(matches) < len(matches)
    assert chosen["completion_agreement"] == pytest.approx(agreement)
    assert all(r > 0 for r in chosen["completion_rho_l1"])


@pytest.mark.slow
def test_the_verdict_is_one_line_in_manifest_summary_and_card(verdict_run, capsys):
    merged, manifest = verdict_run
    selection = manifest["tasks"]["math"]["selection"]
    line = selection["verdict"]
    assert line.startswith("kept pos_corr + l1: held-out completion match 0.167, none 0 (better on")
    assert "\n" not in line
    assert selection["metric"] == "completion_match" and selection["alpha"] == 0.6
    assert selection["completion_tokens"] == TOKENS
    assert f"math: {line}" in (merged / "README.md").read_text()
    print_summary(Manifest.model_validate(manifest), Console(width=400))
    assert f"math: {line}" in capsys.readouterr().out


def test_only_diverged_corrections_keep_the_merge_and_say_why():
    entries = [
        _entry("none", None, [0, 1]),
        {**_entry("standard", "l1", [1, 1]), "diverged": "NaN"},
    ]
    chosen, line = decide(entries, ["none", "standard + l1"], "completion_match", 0.05)
    assert (chosen, line) == (0, "kept no correction: every correction's training diverged")
