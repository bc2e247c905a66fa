"""The held-out verdict (calibrate.verdict): the default selection, checked against real greedy
generation and float64 references on the tiny family."""

from __future__ import annotations

import hashlib
import itertools
import random
import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from scipy.stats import binomtest, norm, rankdata
from tiny import quick_block, surgery_task
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import apply_surgery, run_surgery
from mergekit_darts.calibrate.verdict import (
    Wording,
    completion_reference,
    decide,
    detectable_gain,
    signed_rank_test,
)
from mergekit_darts.config import parse_surgery, resolve_tasks
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.folder.manifest import Manifest
from mergekit_darts.present.summary import print_summary

TOKENS = 3  # completion tokens: short, so that some held-out prompts match and some do not


def _task(tiny_family, calibration_data, **settings) -> dict:
    return surgery_task(
        "math",
        tiny_family.math,
        calibration_data / "math.jsonl",
        calibration={"max_length": 24},
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
        "metric": "completion_match",
        "holdout": 0.5,
        "alpha": 0.6,
        "refit": False,
    }
    block = quick_block(tiny_family, calibration_data, select=select)
    return merged, run_surgery(merged, block, progress=False)


# ---- the signed-rank test and the decision ------------------------------------------------------


def _brute_force_signed_rank(candidate, none) -> tuple[int, int, float, float]:
    """float64 reference: (better, worse, W+, p) over every one of the 2^n sign assignments."""
    pairs = [
        (a, b) for a, b in zip(candidate, none, strict=True) if a is not None and b is not None
    ]
    d = [a - b for a, b in pairs if a != b]
    if not d:
        return 0, 0, 0.0, 1.0
    ranks = rankdata([abs(x) for x in d])  # mid-ranks for ties
    observed = sum(r for r, x in zip(ranks, d, strict=True) if x > 0)
    sums = [
        sum(r for r, s in zip(ranks, signs, strict=True) if s)
        for signs in itertools.product((0, 1), repeat=len(d))
    ]
    p = sum(1.0 for w in sums if w >= observed - 1e-9) / len(sums)
    return sum(x > 0 for x in d), sum(x < 0 for x in d), float(observed), p


@pytest.mark.parametrize(
    ("candidate", "none"),
    [
        ([1, 1, 1, 1, 1], [0, 0, 0, 0, 0]),
        ([1, 1, 0, 1, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]),
        ([0.5, 0.2, 0.9, None, 0.4], [0.5, 0.3, 0.1, 0.7, 0.2]),
        ([0, 0, 0], [0, 0, 0]),
        ([12, 3, 30, 7, 7, 0, 18, 5, 9, 2, 31], [4, 3, 12, 9, 1, 2, 18, 5, 1, 6, 0]),  # tied sizes
        ([5, 6, 7, 8, 9, 10, 11, 12], [6, 4, 4, 3, 3, 2, 1, 0]),
    ],
)
def test_signed_rank_test_is_the_exact_one_sided_test(candidate, none):
    result = signed_rank_test(candidate, none)
    better, worse, statistic, p = _brute_force_signed_rank(candidate, none)
    pairs = sum(a is not None and b is not None for a, b in zip(candidate, none, strict=True))
    assert (result["better"], result["worse"], result["prompts"]) == (better, worse, pairs)
    assert result["statistic"] == pytest.approx(statistic)
    assert result["p"] == pytest.approx(p, rel=1e-12)


def test_on_0_1_outcomes_the_signed_rank_test_is_the_sign_test():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 40)
        candidate = [rng.randint(0, 1) for _ in range(n)]
        none = [rng.randint(0, 1) for _ in range(n)]
        result = signed_rank_test(candidate, none)
        k, m = result["better"], result["better"] + result["worse"]
        expected = binomtest(k, m, 0.5, alternative="greater").pvalue if m else 1.0
        assert result["p"] == pytest.approx(expected, rel=1e-9)


def _simulated_verdicts(trials: int, seed: int, shift: float | None = None) -> tuple[float, float]:
    """(share of trials where decide keeps a correction, mean stated detectable gain) over 50
    prompts with graded outcomes 0..32 for none and three corrections.

    ``shift`` None: each correction is none plus symmetric integer noise (half the prompts
    unchanged, the rest moved by 1..4 tokens either way): no correction is better. Else each
    correction's differences are normal with sd 3, the first's with mean ``shift``: the model
    under which the stated detectable gain is computed.
    """
    rng = random.Random(seed)
    kept, stated = 0, 0.0
    for _ in range(trials):
        none = [float(rng.randint(0, 32)) for _ in range(50)]
        entries = [_entry("none", None, none, "completion_prefix")]
        for c in range(3):
            if shift is None:
                moved = [
                    rng.choice((-1, 1)) * rng.randint(1, 4) * (rng.random() < 0.5) for _ in none
                ]
            else:
                moved = [rng.gauss(shift if c == 0 else 0.0, 3) for _ in none]
            scores = [x + d for x, d in zip(none, moved, strict=True)]
            entries.append(_entry("pos_corr", "l1", scores, "completion_prefix"))
        decision = decide(entries, ["none", "a", "b", "c"], "completion_prefix", 0.05)
        kept += decision.chosen != 0
        stated += decision.detectable["mean_gain"]
    return kept / trials, stated / trials


def test_with_no_better_candidate_a_correction_is_kept_at_most_alpha_of_the_time():
    # 2000 trials: the binomial standard error at 0.05 is 0.0049 (without Bonferroni: 0.13)
    rate, _ = _simulated_verdicts(2000, seed=1)
    assert rate <= 0.05 + 3 * (0.05 * 0.95 / 2000) ** 0.5


def test_a_gain_of_the_stated_detectable_size_is_kept_with_the_stated_power():
    _, gain = _simulated_verdicts(300, seed=2, shift=0.0)
    assert 1 < gain < 2  # about (z[1 - 0.05/3] + z[0.8]) * 3 / sqrt(50 * 3/pi) = 1.29
    rate, _ = _simulated_verdicts(400, seed=3, shift=gain)
    assert rate >= 0.8 - 3 * (0.8 * 0.2 / 400) ** 0.5
    rate, _ = _simulated_verdicts(400, seed=4, shift=gain / 3)  # a third of it: mostly missed
    assert rate < 0.5


def test_detectable_gain_is_the_normal_approximation_of_the_paired_test():
    d = [3.0, -1.0, 0.0, 4.0, 2.0, -2.0, 5.0, 1.0]
    n = len(d)
    sd = (sum(x * x for x in d) / n) ** 0.5  # the sign-flip null's spread: uncentred
    z_level, z_power = norm.ppf(1 - 0.05 / 3), norm.ppf(0.8)
    expected = (z_level + z_power) * sd / (n * 3 / 3.141592653589793) ** 0.5
    assert detectable_gain([d], 0.05 / 3) == pytest.approx(expected, rel=1e-8)
    assert detectable_gain([[0.0] * 8, [0.0] * 8], 0.05) is None
    # never below what the exact test needs: 6 prompts (2**-6 < 0.05/3) changed by 1 of 50
    few = [1.0, -1.0] + [0.0] * 48
    assert detectable_gain([few], 0.05 / 3) == pytest.approx(6 / 50)


def _entry(
    module: str, loss: str | None, scores: list[float], metric: str = "completion_match"
) -> dict:
    return {
        "module": module,
        "loss": loss,
        "verdict": {metric: scores},
        "held_out": {metric: sum(scores) / len(scores)},
    }


def test_few_held_out_prompts_keep_the_merge_even_when_every_one_improves():
    # 4 prompts, all better: p = 1/16 > 0.05 / 1; the merge stays as it is
    entries = [_entry("none", None, [0, 0, 0, 0]), _entry("pos_corr", "l1", [1, 1, 1, 1])]
    decision = decide(entries, ["none", "pos_corr + l1"], "completion_match", 0.05)
    assert decision.chosen == 0
    assert decision.line.startswith(
        "kept no correction: no candidate beat the merge by the signed-rank test"
    )
    assert "better on 4, worse on 0 of 4 prompts, signed-rank p = 0.0625 > 0.05" in decision.line
    # at 0.05 the exact test needs 5 changed prompts (2**-5 < 0.05 < 2**-4): 4 can never pass
    assert decision.line.endswith(
        "; with 4 prompts no correction can pass (the test needs at least 5 prompts changed, "
        "all for the better)"
    )
    assert decision.detectable["mean_gain"] is None


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
    decision = decide(entries, labels, "completion_match", 0.05)
    assert decision.chosen == 2
    # two corrections measured (the diverged one is not), so each is tested at 0.025
    assert entries[2]["test"]["level"] == pytest.approx(0.025)
    assert "test" not in entries[3]
    assert decision.line.startswith(
        "kept pos_corr + l1: held-out completion match 0.9, none 0 (better on 9, worse on 0 of "
        "10 prompts, signed-rank p = 0.00195 <= 0.025); with 10 prompts the test detects a mean "
        "gain of >= "
    )


def test_on_dev_items_the_test_is_mcnemars_and_the_line_says_so():
    """select metric lm_eval: 0/1 outcomes per dev document; McNemar's exact one-sided test is
    the binomial tail over the discordant documents (7 better, 1 worse: P(X >= 7 | 8, 1/2))."""
    none = [0] * 8 + [1] * 12
    better = [1] * 7 + [0] + [0] + [1] * 11  # 7 documents better, 1 worse
    entries = [_entry("none", None, none, "lm_eval"), _entry("pos_corr", "l1", better, "lm_eval")]
    wording = Wording("exact_match", "dev", "items", "the 20 train documents of gsm8k", "McNemar")
    decision = decide(entries, ["none", "pos_corr + l1"], "lm_eval", 0.05, wording)
    p = binomtest(7, 8, 0.5, alternative="greater").pvalue
    assert entries[1]["test"]["p"] == pytest.approx(p, rel=1e-12)
    assert decision.chosen == 1
    assert decision.line.startswith(
        f"kept pos_corr + l1: dev exact_match 0.9, none 0.6 (better on 7, worse on 1 of 20 items, "
        f"McNemar p = {p:.3g} <= 0.05); with 20 items the test detects a mean gain of >= "
    )
    worse = decide(
        [_entry("none", None, better, "lm_eval"), _entry("pos_corr", "l1", none, "lm_eval")],
        ["none", "pos_corr + l1"],
        "lm_eval",
        0.05,
        wording,
    )
    assert worse.line.startswith(
        "kept no correction: every candidate scored below the merge on the 20 train documents "
        "of gsm8k (best pos_corr + l1: exact_match 0.6, none 0.9; better on 1, worse on 7 of 20 "
        "items, McNemar p = "
    )


def test_every_candidate_below_the_merge_says_so():
    entries = [_entry("none", None, [1, 1, 0]), _entry("standard", "l1", [0, 1, 0])]
    decision = decide(entries, ["none", "standard + l1"], "completion_match", 0.05)
    assert decision.chosen == 0
    assert decision.line.startswith(
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
    assert task.select.metric == "completion_prefix" and task.select.completion_tokens == 128
    assert (task.folds, task.holdout) == (5, 0)
    assert [(c.module, c.loss) for c in task.candidates()] == [
        ("none", "ewl1"),
        ("standard", "l1"),
        ("pos_corr", "l1"),
        ("pos_corr", "ewl1"),
        ("head", "ewl1"),
        ("norm", "ewl1"),
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
    assert message.startswith(
        "surgery.select.folds: 5 folds need at least 5 calibration prompts, and task 'math' has 1"
    )
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
    decision = decide(entries, ["none", "standard + l1"], "completion_match", 0.05)
    assert (decision.chosen, decision.line) == (
        0,
        "kept no correction: every correction's training diverged",
    )
