"""`{module: none}`: the merge as it is, a `select` candidate measured like every other, and a
task's module outright. Never trained; when it wins, the task's correction is the identity."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from tiny import build_tokenizer, save_model, surgery_task
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import apply_surgery, load_surgery, run_surgery
from mergekit_darts.folder.artifacts import read_manifest
from mergekit_darts.present.summary import print_summary

pytestmark = pytest.mark.slow  # every test here trains, merges or starts a process


def _task(name: str, target: Path, data: Path, **settings) -> dict:
    return surgery_task(
        name, target, data / "math.jsonl", calibration={"max_length": 16}, **settings
    )


@pytest.fixture(scope="module")
def none_wins(tiny_merged, calibration_data, tmp_path_factory):
    """The target is the merged model plus a little noise (0.1% of each weight's spread): the
    merge as it is already nearly matches it, while the trained candidates use `ce` (sharpen
    the target's argmax) at a large learning rate, which moves the next-token distribution
    away from the target's, so by KL the merge as it is wins."""
    root = tmp_path_factory.mktemp("none")
    merged = Path(shutil.copytree(tiny_merged, root / "merged"))
    near = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    save_model(root / "near", build_tokenizer(), seed=5, base=near, noise=1e-3)
    candidates = [
        {"module": "pos_corr", "loss": "ce", "lr": 1e-2},
        {"module": "standard", "loss": "ce", "lr": 1e-2},
        {"module": "none"},
    ]
    select = {"candidates": candidates, "metric": "kl", "holdout": 0.25}
    block = {
        "steps": 15,
        "batch_size": 4,
        "rank": 4,
        "max_positions": 16,
        "cache_dtype": "float32",
        "tasks": [_task("math", root / "near", calibration_data, select=select)],
    }
    return merged, run_surgery(merged, block, progress=False)


def test_none_wins_when_every_correction_hurts(none_wins):
    merged, manifest = none_wins
    entry = manifest["tasks"]["math"]
    selection = entry["selection"]
    held = [c["held_out"] for c in selection["candidates"]]
    assert held[2]["rho_l1"] == 0.0  # measured, not trained: delta after = delta before
    assert all(h["kl"] > held[2]["kl"] for h in held[:2]), held
    assert selection["chosen"] == 2 and entry["module"] == "none"
    assert entry["metrics"]["rho_l1"] == 0.0
    assert entry["metrics"]["delta_after"] == entry["metrics"]["delta_before"]
    assert load_file(merged / "surgery" / "math.safetensors") == {}  # no tensors


def test_loaders_give_the_identity(none_wins):
    merged, _ = none_wins
    module = load_surgery(merged / "surgery", "math")
    h = torch.randn(2, 5, 64)
    assert module.kind == "none" and torch.equal(module(h, torch.arange(5).expand(2, 5)), h)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    batch = AutoTokenizer.from_pretrained(merged)("two plus three is", return_tensors="pt")
    with torch.no_grad():
        plain = model(**batch).logits
        with apply_surgery(model, merged / "surgery", task="math"):
            corrected = model(**batch).logits
    assert torch.equal(plain, corrected)


def test_summary_and_card_say_the_merge_won(none_wins):
    merged, _ = none_wins
    console = Console(width=160, record=True)
    print_summary(read_manifest(merged / "surgery"), console)
    text = console.export_text()
    assert "math: no correction (the merge as it is) won on the held-out kl" in text
    assert "none (the merge as it is)" in text
    card = (merged / "README.md").read_text()
    assert "For `math`, no correction (the merge as it is) won" in card


def test_module_none_outright_is_the_baseline(tiny_family, tiny_merged, calibration_data, tmp_path):
    merged = Path(shutil.copytree(tiny_merged, tmp_path / "merged"))
    block = {
        "steps": 5,
        "batch_size": 4,
        "rank": 4,
        "max_positions": 16,
        "tasks": [
            _task("math", tiny_family.math, calibration_data, module="none", holdout=0.25),
            _task("code", tiny_family.code, calibration_data, module="pos_corr"),
        ],
    }
    manifest = run_surgery(merged, block, progress=False, write_card=False)
    entry = manifest["tasks"]["math"]
    assert entry["module"] == "none" and entry["metrics"]["rho_l1"] == 0.0
    assert entry["metrics"]["loss_curve"] == [entry["metrics"]["final_loss"]]  # the identity's
    held = entry["held_out"]["all"]
    assert held["agreement_after"] == held["agreement_before"] and held["rho_l1"] == 0.0
    assert load_surgery(merged / "surgery", "math").kind == "none"
    assert manifest["tasks"]["code"]["metrics"]["rho_l1"] > 0
