"""Generation-aware calibration: the target's own greedy completions, the completion
loss mask, and what continuation calibration buys on completion positions."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import surgery_block
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import load_surgery, run_surgery
from mergekit_darts.calibrate.capture import capture
from mergekit_darts.calibrate.continuation import (
    completion_mask,
    continue_prompts,
    greedy_completions,
    left_pad,
    tokens_sha256,
)
from mergekit_darts.correction.metrics import rho_l1
from mergekit_darts.errors import SurgeryError, SurgeryRunError

NEW_TOKENS = 10


def reference_greedy(model, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    """Greedy decoding written out: no cache, no padding, one full forward per new token."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        if token in eos:
            break
        out.append(token)
        ids.append(token)
    return out


@pytest.fixture(scope="module")
def target(tiny_family):
    model = AutoModelForCausalLM.from_pretrained(tiny_family.math, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_family.math)
    prompts = [tokenizer(p)["input_ids"] for p in tiny_family.prompts]
    assert len({len(p) for p in prompts}) > 3, "prompts of several lengths exercise left padding"
    return model, prompts


def test_completions_equal_an_independent_greedy_decode(target):
    model, prompts = target
    got = greedy_completions(
        model, prompts, max_new_tokens=NEW_TOKENS, eos_ids={3}, batch_size=5, progress=False
    )
    assert got == [reference_greedy(model, p, NEW_TOKENS, {3}) for p in prompts]


def test_completion_stops_at_eos_and_ignores_sampling_settings(target):
    model, prompts = target
    free = reference_greedy(model, prompts[0], NEW_TOKENS, set())
    eos = {free[3]}  # a token the target writes at step 4: the completion must end before it
    model.generation_config.do_sample = True
    model.generation_config.temperature = 5.0
    model.generation_config.repetition_penalty = 3.0
    try:
        got = greedy_completions(
            model, prompts, max_new_tokens=NEW_TOKENS, eos_ids=eos, batch_size=4, progress=False
        )
        assert model.generation_config.repetition_penalty == 3.0, "restored after the call"
    finally:
        model.generation_config.do_sample = False
        model.generation_config.temperature = None
        model.generation_config.repetition_penalty = None
    assert got[0] == free[: free.index(free[3])]
    assert got == [reference_greedy(model, p, NEW_TOKENS, eos) for p in prompts]


def test_continued_sequences_and_completion_mask(target):
    model, prompts = target
    continued = continue_prompts(
        model, prompts, max_new_tokens=6, eos_ids={3}, batch_size=8, progress=False
    )
    assert continued.mask.shape == (len(prompts), max(len(s) for s in continued.sequences))
    for row, (prompt, completion) in enumerate(zip(prompts, continued.completions, strict=True)):
        assert continued.sequences[row] == prompt + completion
        expected = torch.zeros(continued.mask.shape[1], dtype=torch.bool)
        expected[len(prompt) : len(prompt) + len(completion)] = True
        assert torch.equal(continued.mask[row], expected)


def test_small_pieces():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert completion_mask([2, 1], [1, 0]).tolist() == [[False, False, True], [False] * 3]


def test_bad_calls(target):
    model, prompts = target
    with pytest.raises(ValueError, match="max_new_tokens must be > 0"):
        greedy_completions(model, prompts, max_new_tokens=0, eos_ids={3})
    with pytest.raises(ValueError, match="no empty prompt"):
        greedy_completions(model, [[2, 5], []], max_new_tokens=2, eos_ids={3})


# ---- through run_surgery -------------------------------------------------------------------------


def surgery(data: Path, target: Path, **task) -> dict:
    return surgery_block(
        target,
        data / "math.jsonl",
        calibration={"max_length": 48, **task.pop("calibration", {})},
        task=task,
        steps=60,
        lr=1e-2,
        loss="l1",
        batch_size=4,
    )


@pytest.mark.slow
def test_completion_loss_covers_exactly_the_completion_tokens(
    tiny_family, calibration_data, merged_copy
):
    config = surgery(
        calibration_data,
        tiny_family.math,
        calibration={"continuation_tokens": 12},
        loss_positions="completion",
    )
    manifest = run_surgery(merged_copy, config, progress=False)
    entry = manifest["tasks"]["math"]
    cal, metrics = entry["calibration"], entry["metrics"]
    diag = load_file(merged_copy / "surgery" / entry["diagnostics"])
    assert torch.equal(diag["loss_mask"], diag["completion_mask"])
    assert metrics["tokens"] == int(diag["completion_mask"].sum()) == sum(cal["completion_tokens"])
    assert metrics["rho_l1"] == pytest.approx(metrics["rho_l1_completion"])
    for row, (n_prompt, n_new) in enumerate(
        zip(cal["prompt_tokens"], cal["completion_tokens"], strict=True)
    ):
        assert 0 < n_new <= 12 and n_prompt + n_new <= 48
        assert diag["completion_mask"][row].nonzero().flatten().tolist() == list(
            range(n_prompt, n_prompt + n_new)
        )
        completion = diag["input_ids"][row, n_prompt : n_prompt + n_new].tolist()
        assert cal["completion_sha256"][row] == tokens_sha256(completion)
    # the completions are the target's own greedy ones
    model = AutoModelForCausalLM.from_pretrained(tiny_family.math, dtype=torch.float32).eval()
    row = 0
    prompt = diag["input_ids"][row, : cal["prompt_tokens"][row]].tolist()
    expected = reference_greedy(model, prompt, 12, {3})
    assert diag["input_ids"][row, len(prompt) : len(prompt) + len(expected)].tolist() == expected


@pytest.mark.slow
def test_continuation_calibration_improves_rho_on_completion_positions(
    tiny_family, calibration_data, tmp_path, tiny_merged
):
    """A module calibrated on prompts alone never saw answer positions; one calibrated on
    prompt + completion did. Both are measured on the same completion positions."""
    prompts_only = Path(shutil.copytree(tiny_merged, tmp_path / "prompts_only"))
    continued = Path(shutil.copytree(tiny_merged, tmp_path / "continued"))
    run_surgery(prompts_only, surgery(calibration_data, tiny_family.math), progress=False)
    manifest = run_surgery(
        continued,
        surgery(calibration_data, tiny_family.math, calibration={"continuation_tokens": 16}),
        progress=False,
    )
    diag = load_file(continued / "surgery" / manifest["tasks"]["math"]["diagnostics"])
    sequences = [
        row[: int(n)].tolist()
        for row, n in zip(diag["input_ids"], diag["mask"].sum(-1), strict=True)
    ]
    h_target = _hidden(tiny_family.math, sequences)
    h_merged = _hidden(tiny_merged, sequences)
    positions = torch.arange(h_merged.hidden.shape[1]).expand(len(sequences), -1)
    on_completion = diag["completion_mask"]
    rho = {}
    for name, folder in (("prompts_only", prompts_only), ("continued", continued)):
        module = load_surgery(folder / "surgery", "math")
        with torch.no_grad():
            h_hat = module(h_merged.hidden.float(), positions)
        rho[name] = rho_l1(h_merged.hidden, h_hat, h_target.hidden, on_completion)
    assert rho["continued"] == pytest.approx(
        manifest["tasks"]["math"]["metrics"]["rho_l1_completion"], abs=1e-4
    )
    assert rho["continued"] > rho["prompts_only"] + 0.05, rho
    assert rho["continued"] > 0.2, rho


def _hidden(folder: Path, sequences: list[list[int]]):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return capture(model, sequences, cache_dtype=torch.float32, progress=False)


@pytest.mark.slow
def test_target_that_ends_every_completion_at_once(
    tiny_family, calibration_data, merged_copy, tmp_path
):
    """With EOS first everywhere there is nothing for `loss_positions: completion` to train on."""
    mute = Path(shutil.copytree(tiny_family.math, tmp_path / "mute"))
    vocab = json.loads((mute / "config.json").read_text())["vocab_size"]
    for name in ("config.json", "generation_config.json"):
        spec = json.loads((mute / name).read_text())
        spec["eos_token_id"] = list(range(vocab))  # every token ends the sequence
        (mute / name).write_text(json.dumps(spec))
    config = surgery(
        calibration_data,
        mute,
        calibration={"continuation_tokens": 8},
        loss_positions="completion",
    )
    with pytest.raises(SurgeryRunError) as info:
        run_surgery(merged_copy, config, progress=False)
    message = str(info.value)
    assert message.startswith("surgery task 'math': the target ended every completion at once")
    assert isinstance(info.value, SurgeryError) and "\n" not in message
    assert not (merged_copy / "surgery").exists()
