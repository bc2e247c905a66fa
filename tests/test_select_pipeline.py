"""`select:` and `holdout:` through run_surgery on the tiny family: manifest, refit, printed table."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny import build_tokenizer, surgery_block, tiny_config
from transformers import GraniteConfig, GraniteForCausalLM

from mergekit_darts import load_surgery, run_surgery
from mergekit_darts.correction import head
from mergekit_darts.errors import SurgeryRunError

pytestmark = pytest.mark.slow  # every test here trains, merges or starts a process

CANDIDATES = [
    {"module": "standard", "loss": "l1"},
    {"module": "pos_corr", "loss": "l1"},
    {"module": "pos_corr", "loss": "ewl1", "rank": 4},
]


def _block(tiny_family, calibration_data, continuation_tokens: int = 0, **task) -> dict:
    return surgery_block(
        tiny_family.math,
        calibration_data / "math.jsonl",
        calibration={"max_length": 24, "continuation_tokens": continuation_tokens},
        task=task,
        steps=15,
        batch_size=4,
        max_positions=32,
    )


@pytest.fixture(scope="module")
def selected(tiny_family, calibration_data, tiny_merged, tmp_path_factory):
    merged = Path(shutil.copytree(tiny_merged, tmp_path_factory.mktemp("sel") / "merged"))
    select = {"candidates": CANDIDATES, "holdout": 0.25, "metric": "agreement"}
    block = _block(tiny_family, calibration_data, continuation_tokens=3, select=select)
    return merged, block, run_surgery(merged, block, progress=False)


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_selection_manifest_names_the_best_candidate(selected, tiny_family):
    merged, _, manifest = selected
    entry = manifest["tasks"]["math"]
    selection = entry["selection"]
    assert selection["metric"] == "agreement" and selection["refit"] is True
    scores = [c["held_out"]["agreement"] for c in selection["candidates"]]
    assert all(0 <= s <= 1 for s in scores)
    assert selection["chosen"] == scores.index(max(scores))
    chosen = selection["candidates"][selection["chosen"]]
    assert (entry["module"], entry["loss"], entry["rank"]) == (
        chosen["module"],
        chosen["loss"],
        chosen["rank"],
    )
    assert [c["rank"] for c in selection["candidates"]] == [16, 16, 4]
    # 12 prompts, 0.25 held out: 3 of the prompts' hashes, the same on every run
    held = selection["holdout_sha256"]
    every = {_sha(p) for p in tiny_family.prompts}
    assert len(held) == 3 and set(held) <= every
    assert entry["held_out"]["prompt_sha256"] == held
    assert entry["held_out"]["saved_module"] is False  # the numbers are pre-refit
    card = (merged / "README.md").read_text()
    assert "### Held-out measurement and selection" in card and "✓ by agreement" in card
    for positions in ("all", "completion"):
        metrics = entry["held_out"][positions]
        assert metrics["tokens"] > 0
        assert {"agreement_before", "agreement_after", "kl_before", "kl_after", "rho_l1"} <= set(
            metrics
        )


def test_refit_equals_a_fixed_task_with_the_chosen_settings(
    selected, tiny_family, calibration_data, tmp_path, tiny_merged
):
    merged, block, manifest = selected
    chosen = manifest["tasks"]["math"]["selection"]
    settings = dict(CANDIDATES[chosen["chosen"]])
    fixed = json.loads(json.dumps(block))
    fixed["tasks"][0].pop("select")
    fixed["tasks"][0].update(settings)
    other = Path(shutil.copytree(tiny_merged, tmp_path / "fixed"))
    run_surgery(other, fixed, progress=False)
    a = (merged / "surgery" / "math.safetensors").read_bytes()
    assert a == (other / "surgery" / "math.safetensors").read_bytes()
    module = load_surgery(merged / "surgery", "math")  # the manifest names the kept module
    assert module.kind == settings["module"]


def test_fixed_task_with_holdout_trains_without_the_held_out_prompts(
    tiny_family, calibration_data, merged_copy, capsys
):
    block = _block(tiny_family, calibration_data, holdout=0.5, loss="l1")
    manifest = run_surgery(merged_copy, block)
    entry = manifest["tasks"]["math"]
    assert "selection" not in entry
    held = entry["held_out"]
    assert held["saved_module"] is True and len(held["prompt_sha256"]) == 6
    assert "completion" not in held
    all_tokens = sum(entry["calibration"]["prompt_tokens"])
    assert entry["metrics"]["tokens"] + held["all"]["tokens"] == all_tokens
    out = capsys.readouterr().out
    assert "held-out" in out and "→" in out, out


def test_refit_off_keeps_the_candidate(tiny_family, calibration_data, merged_copy):
    select = {"candidates": CANDIDATES[:2], "metric": "rho_l1", "refit": False, "holdout": 0.2}
    manifest = run_surgery(
        merged_copy, _block(tiny_family, calibration_data, select=select), progress=False
    )
    entry = manifest["tasks"]["math"]
    assert entry["held_out"]["saved_module"] is True
    rhos = [c["held_out"]["rho_l1"] for c in entry["selection"]["candidates"]]
    assert entry["selection"]["chosen"] == rhos.index(max(rhos))
    assert entry["metrics"]["tokens"] + entry["held_out"]["all"]["tokens"] == sum(
        entry["calibration"]["prompt_tokens"]
    )


def test_logit_features_refuse_an_output_path_they_do_not_know(
    tiny_family, calibration_data, tmp_path, monkeypatch
):
    """Granite with its logits_scaling taken out of the table: an architecture we do not know."""
    tokenizer = build_tokenizer()
    folders = {}
    for name, seed in (("merged", 0), ("target", 1)):
        torch.manual_seed(seed)
        config = GraniteConfig(**tiny_config(len(tokenizer)).to_dict(), logits_scaling=4.0)
        GraniteForCausalLM(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        folders[name] = tmp_path / name
    monkeypatch.delitem(head.SCALES, "granite")
    block = _block(tiny_family, calibration_data, target=str(folders["target"]))
    for task in ({"select": {"candidates": CANDIDATES[:1]}}, {"loss": "kl"}):
        block["tasks"][0] = {
            k: v for k, v in block["tasks"][0].items() if k not in ("select", "loss")
        }
        block["tasks"][0].update(task)
        with pytest.raises(SurgeryRunError) as err:
            run_surgery(folders["merged"], block, progress=False)
        message = str(err.value)
        assert message.startswith("surgery task 'math': ") and "GraniteForCausalLM" in message
        assert "\n" not in message and not (folders["merged"] / "surgery").exists()
    block["tasks"][0].pop("loss")
    block["tasks"][0]["select"] = {"candidates": CANDIDATES[:2], "metric": "rho_l1"}
    manifest = run_surgery(folders["merged"], block, progress=False)  # l1 / ewl1 by rho_L1: fine
    candidates = manifest["tasks"]["math"]["selection"]["candidates"]
    assert all(c["held_out"]["agreement"] is None for c in candidates)


def test_selection_reads_heads_back_from_the_disk_store(
    tiny_family, calibration_data, tiny_merged, tmp_path
):
    select = {"candidates": CANDIDATES[:2], "metric": "kl"}
    block = _block(tiny_family, calibration_data, select=select) | {
        "cache_dir": str(tmp_path / "cache")
    }
    merged = Path(shutil.copytree(tiny_merged, tmp_path / "merged"))
    first = run_surgery(merged, block, progress=False)
    second = run_surgery(merged, block, progress=False, overwrite=True)  # every capture from disk
    assert second["captures"]["from_disk"] == 2 and second["captures"]["model_loads"] == 0
    assert second["tasks"]["math"]["selection"] == first["tasks"]["math"]["selection"]
    assert all(
        c["held_out"]["kl"] is not None for c in first["tasks"]["math"]["selection"]["candidates"]
    )


def test_printed_summary_shows_every_candidate_and_the_kept_one(selected):
    from io import StringIO

    from rich.console import Console

    from mergekit_darts.folder.manifest import Manifest
    from mergekit_darts.present.summary import print_summary

    _, _, manifest = selected
    out = StringIO()
    print_summary(Manifest.from_dict(manifest), Console(file=out, width=140))
    text = out.getvalue()
    selection = manifest["tasks"]["math"]["selection"]
    kept = selection["candidates"][selection["chosen"]]
    assert text.count("✓ by agreement") == 1
    kept_line = next(line for line in text.splitlines() if "✓ by agreement" in line)
    assert f"{kept['module']} + {kept['loss']}" in kept_line
    assert "standard + l1" in text and "pos_corr + ewl1, rank 4" in text  # rank differs: shown
    assert "all (before refit)" in text and "completion (before refit)" in text
