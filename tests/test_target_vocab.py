"""Vocabularies that differ between targets and the merge: targets that append tokens
(WizardMath's 32001 vs 32000, `surgery.target_vocab: prefix`), merges whose embedding rows
mergekit pads (`tokenizer.pad_to_multiple_of`), and tokenizers transformers loads unlike they
were saved (qwen2 under transformers 5; README, "Known issues")."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from tiny import (
    PROMPTS,
    build_bpe_tokenizer,
    build_tokenizer,
    merge,
    merge_config,
    refuse,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from mergekit_darts.config import check_targets, parse_surgery, resolve_tasks
from mergekit_darts.errors import SurgeryConfigError


def _with_target(config, target, **block):
    config["surgery"]["tasks"] = config["surgery"]["tasks"][:1]
    config["surgery"]["tasks"][0]["target"] = str(target)
    config["surgery"].update(block)
    return config


def test_appended_tokens_are_refused_by_default(tiny_family, calibration_data, extended, tmp_path):
    config = _with_target(merge_config(tiny_family, calibration_data), extended / "math_plus")
    message = refuse(config, tmp_path / "out")
    assert "vocab_size" in message and "target_vocab: prefix" in message


def test_prefix_refuses_kl_and_moved_ids(tiny_family, calibration_data, extended, tmp_path):
    config = _with_target(
        merge_config(tiny_family, calibration_data), extended / "math_plus", target_vocab="prefix"
    )
    config["surgery"]["loss"] = "kl"
    assert "vocab_size" in refuse(config, tmp_path / "a")
    config = _with_target(
        merge_config(tiny_family, calibration_data),
        extended / "math_swapped",
        target_vocab="prefix",
    )
    assert "4 token/id pairs differ" in refuse(config, tmp_path / "b")


@pytest.mark.slow
def test_prefix_target_calibrates(tiny_family, calibration_data, extended, tmp_path):
    config = _with_target(
        merge_config(tiny_family, calibration_data), extended / "math_plus", target_vocab="prefix"
    )
    out = tmp_path / "out"
    manifest = merge(config, out)
    _measured_by_the_verdict(manifest["tasks"]["math"])
    config["surgery"]["select"] = "off"  # the paper's recipe: one module, trained
    manifest = merge(config, tmp_path / "off")
    assert manifest["tasks"]["math"]["metrics"]["rho_l1"] > 0


def _measured_by_the_verdict(entry: dict) -> None:
    """The default selection ran its verdict with the merged head (any target vocabulary)."""
    for candidate in entry["selection"]["candidates"]:
        assert None not in candidate["verdict"]["completion_match"]
    assert entry["selection"]["verdict"].startswith("kept ")


def _padded(config: dict) -> dict:
    """The merge builds a union tokenizer and pads its embedding rows to a multiple of 64."""
    config["tokenizer"] = {"source": "union", "pad_to_multiple_of": 64}
    return config


@pytest.mark.slow
@pytest.mark.parametrize("target_vocab", ["exact", "prefix"])
def test_padded_merged_vocabulary_calibrates(tiny_family, calibration_data, tmp_path, target_vocab):
    """mergekit pads 65 token rows to 128; every token keeps its id, so l1/ewl1 calibrate."""
    config = _padded(merge_config(tiny_family, calibration_data))
    config["surgery"]["target_vocab"] = target_vocab
    config["surgery"]["tasks"][1]["loss"] = "l1"
    out = tmp_path / "out"
    manifest = merge(config, out)
    rows = len(build_tokenizer())
    assert json.loads((out / "config.json").read_text())["vocab_size"] == -(-rows // 64) * 64 > rows
    assert manifest["vocab_size"] == 128
    _measured_by_the_verdict(manifest["tasks"]["math"])  # the default
    assert manifest["tasks"]["code"]["metrics"]["rho_l1"] > 0


def test_padded_merge_refuses_kl_before_merging(tiny_family, calibration_data, tmp_path):
    config = _padded(merge_config(tiny_family, calibration_data))
    config["surgery"]["tasks"][0]["loss"] = "kl"
    message = refuse(config, tmp_path / "out")
    assert message.startswith("surgery.tasks[0].loss: kl compares"), message
    assert "pad_to_multiple_of: 64" in message and "has 65" in message
    assert "use loss l1 or ewl1" in message and "target_vocab" not in message


def test_padded_rows_after_the_merge_follow_the_same_rules(tiny_family, extended, tmp_path):
    """``check_targets`` against a padded merged folder: l1 accepted, ce refused, no false hint."""
    padded = tmp_path / "padded"
    shutil.copytree(tiny_family.math, padded)
    model = AutoModelForCausalLM.from_pretrained(padded)
    model.resize_token_embeddings(128)
    model.save_pretrained(padded)

    def check(loss: str, target, target_vocab: str = "exact") -> None:
        block = {
            "target_vocab": target_vocab,
            "tasks": [
                {"name": "t", "target": str(target), "loss": loss, "calibration": {"path": "x.txt"}}
            ],
        }
        config = parse_surgery(block)
        check_targets(
            resolve_tasks(config),
            str(padded),
            "merged model",
            trust_remote_code=False,
            target_vocab=config.target_vocab,
        )

    check("l1", tiny_family.code)
    check("ewl1", tiny_family.code, "prefix")
    with pytest.raises(SurgeryConfigError) as info:
        check("ce", tiny_family.code)
    message = str(info.value)
    assert "has vocab_size 65, the merged model has 128" in message
    assert "loss ce" in message and "target_vocab: prefix" not in message.split("(with")[0]
    # a target that appends a token to a padded merge: the hint names prefix, which then accepts it
    with pytest.raises(SurgeryConfigError, match="adds tokens: set surgery.target_vocab: prefix"):
        check("l1", extended / "math_plus")
    check("l1", extended / "math_plus", "prefix")


def qwen2(folder, tokenizer):
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def check_against_itself(folder) -> None:
    """Preflight with ``folder`` as target and reference: only its tokenizer can warn."""
    block = {"tasks": [{"name": "t", "target": str(folder), "calibration": {"path": "x.txt"}}]}
    check_targets(
        resolve_tasks(parse_surgery(block)), str(folder), "model", trust_remote_code=False
    )


def test_qwen2_with_a_word_level_tokenizer_is_reported(tmp_path, caplog):
    """transformers 5 loads any qwen2 tokenizer as Qwen2Tokenizer; a word-level one is mangled."""
    word = qwen2(tmp_path / "word", build_tokenizer())
    loaded = AutoTokenizer.from_pretrained(word)
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    assert loaded(PROMPTS[0])["input_ids"] != build_tokenizer()(PROMPTS[0])["input_ids"]
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        check_against_itself(word)
    (message,) = [r.getMessage() for r in caplog.records if "Qwen2Tokenizer" in r.getMessage()]
    assert "WordLevel" in message and "byte-level BPE" in message


def test_qwen2_with_the_byte_level_bpe_test_tokenizer_is_clean(tmp_path, caplog):
    tokenizer = build_bpe_tokenizer()
    bpe = qwen2(tmp_path / "bpe", tokenizer)
    loaded = AutoTokenizer.from_pretrained(bpe)
    for prompt in PROMPTS:
        assert loaded(prompt)["input_ids"] == tokenizer(prompt)["input_ids"]
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        check_against_itself(bpe)
    assert not [r for r in caplog.records if "Qwen2Tokenizer" in r.getMessage()]
