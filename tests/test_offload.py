"""Calibration on models that accelerate splits across the CPU and disk offload.

A 70B merge and its targets do not fit in memory: ``from_pretrained(device_map=..., max_memory=...,
offload_folder=...)`` keeps some decoder layers on the CPU and the rest on disk, with accelerate's
hooks loading each offloaded layer (and the LM head) only for its forward pass. The captures and
the module trained on them must be those of the model loaded whole: here they are bit-identical
(same float32 kernels on the same shapes; offloading only moves weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts.calibrate.capture import Captured, capture
from mergekit_darts.calibrate.continuation import eos_token_ids, greedy_completions
from mergekit_darts.calibrate.train import TrainSettings, train_surgery
from mergekit_darts.correction.modules import build_module


def load(folder: Path, offload: Path | None = None, split: bool = True) -> Any:
    """The model whole in memory, or offloaded: ``split``, the embeddings and layer 0 on the CPU
    and the rest on disk; otherwise all of it on disk."""
    if offload is None:
        return AutoModelForCausalLM.from_pretrained(folder, dtype="auto").eval()
    whole = AutoModelForCausalLM.from_pretrained(folder, dtype="auto")
    size = {name: p.numel() * p.element_size() for name, p in whole.named_parameters()}
    layer = sum(v for k, v in size.items() if k.startswith("model.layers.0."))
    embed, head = size["model.embed_tokens.weight"], size["lm_head.weight"]
    # accelerate keeps room for the largest offloaded layer on the CPU: the embeddings, layer 0
    # and that room fit; the whole model (two layers and the head) does not
    budget = embed + 2 * layer + head // 2 if split else embed // 2
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        dtype="auto",
        device_map="auto",
        max_memory={"cpu": budget},
        offload_folder=str(offload),
    )
    placed = model.hf_device_map
    if split:
        assert placed["model.layers.0"] == "cpu" and placed["model.layers.1"] == "disk", placed
        assert placed["lm_head"] == "disk"
    else:
        assert placed == {"": "disk"}, placed
    assert model.get_output_embeddings().weight.is_meta
    return model.eval()


def captures(model: Any, sequences: list[list[int]]) -> tuple[Captured, Captured]:
    """(as the merged model, as a target): hidden states, entropies and the checked head."""
    common = dict(batch_size=4, cache_dtype=torch.float32, with_head=True, progress=False)
    as_merged = capture(model, sequences, **common)
    as_target = capture(model, sequences, with_entropy=True, **common)
    return as_merged, as_target


def assert_same(a: Captured, b: Captured) -> None:
    assert torch.equal(a.hidden, b.hidden) and torch.equal(a.mask, b.mask)
    assert (a.entropy is None) == (b.entropy is None)
    assert a.entropy is None or torch.equal(a.entropy, b.entropy)
    assert torch.equal(a.head.weight, b.head.weight) and a.head.verified and b.head.verified


@pytest.fixture(scope="module")
def sequences(tiny_family: Any) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_family.base)
    return [tokenizer(p)["input_ids"] for p in tiny_family.prompts]


@pytest.mark.parametrize(("loss", "split"), [("ewl1", True), ("kl", True), ("kl", False)])
def test_offloaded_model_captures_and_trains_like_whole(
    tiny_merged: Path, tiny_family: Any, sequences: list, tmp_path: Path, loss: str, split: bool
) -> None:
    found = {}
    for how, offload in (("whole", None), ("split", tmp_path / "offload")):
        merged, _ = captures(load(tiny_merged, offload and offload / "merged", split), sequences)
        target_model = load(tiny_family.math, offload and offload / "math", split)
        _, target = captures(target_model, sequences)
        eos = eos_token_ids(target_model)
        generated = greedy_completions(
            target_model, sequences, max_new_tokens=4, eos_ids=eos, batch_size=4, progress=False
        )
        module = build_module("pos_corr", merged.hidden.shape[-1], 4, 12, seed=0)
        settings = TrainSettings(loss=loss, steps=20, lr=1e-2, batch_size=4, seed=0)
        trained = train_surgery(module, merged, target, settings, progress=False)
        found[how] = (merged, target, trained, generated)
    merged, target, whole, generated = found["whole"]
    split_merged, split_target, split, split_generated = found["split"]
    assert split_generated == generated  # a target's greedy continuations (continuation_tokens)
    assert any(len(c) > 0 for c in generated)
    assert_same(merged, split_merged)
    assert_same(target, split_target)
    # the head is the checkpoint's own LM head (read from the file, not through the model)
    head = load_file(tiny_family.math / "model.safetensors")["lm_head.weight"]
    assert torch.equal(split_target.head.weight, head.to(torch.float32))
    assert whole.loss_curve == split.loss_curve and whole.rho_l1 == split.rho_l1
    for (name, a), (_, b) in zip(
        whole.module.state_dict().items(), split.module.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
