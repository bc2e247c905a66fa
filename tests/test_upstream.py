"""Traps in the libraries underneath (README, "Known issues"), guarded where we can.

The qwen2 tokenizer trap is detected by the preflight vocabulary check; its tests live with that
check in test_target_vocab.py."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from tiny import build_tokenizer, merge, surgery_block
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

pytestmark = pytest.mark.slow  # every test here trains, merges or starts a process


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
        "surgery": surgery_block(
            folders[1],
            calibration_data / "math.jsonl",
            name="expert",
            calibration={"max_length": 24},
            task={"loss": "l1"},
            steps=5,
        ),
    }
    out = tmp_path / "out"
    manifest = merge(config, out)
    assert AutoModelForCausalLM.from_pretrained(out).config.model_type == "gpt_neox"
    assert manifest["tasks"]["expert"]["metrics"]["rho_l1"] > 0
