"""The head is checked on the first batch of the first capture, and shared per model.

Real models throughout: Granite with its ``logits_scaling`` taken out of the known transforms
(an output path mergekit-darts does not know), and the tiny Llama family.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny import build_tokenizer, surgery_task, tiny_config
from transformers import AutoModelForCausalLM, GraniteConfig, GraniteForCausalLM

from mergekit_darts import run_surgery
from mergekit_darts.correction import head
from mergekit_darts.errors import SurgeryRunError

pytestmark = pytest.mark.slow  # every test here trains, merges or starts a process


@pytest.fixture
def forwards(monkeypatch) -> list[tuple[str, int]]:
    """(folder name, batch rows) of every forward of every model loaded (the real models run)."""
    calls: list[tuple[str, int]] = []
    original = AutoModelForCausalLM.from_pretrained

    def counting(path, *args, **kwargs):
        model = original(path, *args, **kwargs)
        name = Path(path).name
        model.register_forward_pre_hook(
            lambda _m, _a, kw: calls.append((name, kw["input_ids"].shape[0])), with_kwargs=True
        )
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counting)
    return calls


def _task(name: str, target: Path, data: Path, prompts: str, count: int, **settings) -> dict:
    """Task ``name`` on ``count`` prompts of ``data/<prompts>.jsonl``."""
    calibration = {"num_samples": count, "max_length": 16}
    return surgery_task(
        name, target, data / f"{prompts}.jsonl", calibration=calibration, **settings
    )


def test_an_unknown_head_fails_after_one_batch_of_the_first_capture(
    calibration_data, tmp_path, monkeypatch, forwards
):
    tokenizer = build_tokenizer()
    for name, seed in (("merged", 0), ("target", 1), ("other", 2)):
        torch.manual_seed(seed)
        config = GraniteConfig(**tiny_config(len(tokenizer)).to_dict(), logits_scaling=4.0)
        GraniteForCausalLM(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    monkeypatch.delitem(head.SCALES, "granite")
    tasks = [
        _task("math", tmp_path / "target", calibration_data, "math", 12, loss="kl"),
        _task("code", tmp_path / "other", calibration_data, "code", 12),
    ]
    block = {"steps": 2, "batch_size": 4, "rank": 4, "max_positions": 16, "tasks": tasks}
    with pytest.raises(SurgeryRunError) as caught:
        run_surgery(tmp_path / "merged", block, progress=False)
    message = str(caught.value)
    assert message.startswith("surgery task 'math': loss kl needs the model's own logits")
    assert "GraniteForCausalLM" in message and "\n" not in message
    # one batch of 4 of the first target's 12 prompts; the other target and the merge never ran
    assert forwards == [("target", 4)]
    assert not (tmp_path / "merged" / "surgery").exists()


def test_captures_of_one_model_share_one_head(tiny_family, calibration_data, tiny_merged, tmp_path):
    """Two kl tasks with different prompts on one target: one head copy per model, also from disk."""
    from mergekit_darts.calibrate.pipeline import capture_tasks, prepare_surgery
    from mergekit_darts.calibrate.store import CaptureStore

    merged = Path(shutil.copytree(tiny_merged, tmp_path / "merged"))
    tasks = [
        _task(name, tiny_family.math, calibration_data, "math", n)
        for name, n in (("a", 6), ("b", 9))
    ]
    block = {
        "loss": "kl",
        "steps": 2,
        "batch_size": 4,
        "rank": 4,
        "max_positions": 16,
        "tasks": tasks,
    }
    prepared = prepare_surgery(block, reference=str(merged), reference_label="m", out_path=merged)
    reference = AutoModelForCausalLM.from_pretrained(tiny_family.math).lm_head.weight
    cache = tmp_path / "cache"
    for store in (CaptureStore(cache), CaptureStore(cache)):  # cold, then every entry from disk
        runs = capture_tasks(merged, prepared, progress=False, store=store).runs
        a, b = (run.target.head for run in runs)
        assert a is b and torch.equal(a.weight, reference.float()) and a.verified
        assert runs[0].merged.head is runs[1].merged.head and runs[0].merged.head.verified
    assert store.stats.from_disk == 4 and store.stats.model_loads == 0
    assert len(json.loads(json.dumps(run_surgery(merged, block, progress=False)["tasks"]))) == 2
