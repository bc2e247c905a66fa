"""Traps in the libraries underneath (README, "Known issues"), guarded where we can."""

from __future__ import annotations

import logging

import torch
from safetensors import safe_open
from test_config import merge
from tiny import PROMPTS, build_bpe_tokenizer, build_tokenizer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from mergekit_darts.config import check_targets, parse_surgery, resolve_tasks


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


def check(folder) -> None:
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
        check(word)
    (message,) = [r.getMessage() for r in caplog.records if "Qwen2Tokenizer" in r.getMessage()]
    assert "WordLevel" in message and "byte-level BPE" in message


def test_qwen2_with_the_byte_level_bpe_test_tokenizer_is_clean(tmp_path, caplog):
    tokenizer = build_bpe_tokenizer()
    bpe = qwen2(tmp_path / "bpe", tokenizer)
    loaded = AutoTokenizer.from_pretrained(bpe)
    for prompt in PROMPTS:
        assert loaded(prompt)["input_ids"] == tokenizer(prompt)["input_ids"]
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        check(bpe)
    assert not [r for r in caplog.records if "Qwen2Tokenizer" in r.getMessage()]


def test_gpt_neox_merge_with_surgery(calibration_data, tmp_path):
    """transformers 5 saves no attention.bias / masked_bias / rotary inv_freq, which mergekit
    0.1.5's gpt-neox definition requires; the merge (and the surgery after it) must still run."""
    tokenizer = build_tokenizer()
    folders = []
    for seed, name in enumerate(("base", "expert")):
        torch.manual_seed(seed)
        config = GPTNeoXConfig(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=256,
        )
        GPTNeoXForCausalLM(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        folders.append(str(tmp_path / name))
    with safe_open(tmp_path / "base" / "model.safetensors", framework="pt") as weights:
        saved = list(weights.keys())
    assert not any(key.endswith(".attention.bias") for key in saved), "the trap is gone upstream"
    config = {
        "merge_method": "linear",
        "models": [{"model": f, "parameters": {"weight": 0.5}} for f in folders],
        "dtype": "float32",
        "surgery": {
            "steps": 5,
            "tasks": [
                {
                    "name": "expert",
                    "target": folders[1],
                    "loss": "l1",
                    "calibration": {
                        "path": str(calibration_data / "math.jsonl"),
                        "field": "question",
                        "max_length": 24,
                    },
                }
            ],
        },
    }
    out = tmp_path / "out"
    manifest = merge(config, out)
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "gpt_neox"
    assert manifest["tasks"]["expert"]["metrics"]["rho_l1"] > 0
