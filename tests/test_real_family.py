"""The SmolLM2 family of `make demo-real` (demo.real_family), marker `real`.

A recipe cut to two training steps checks what the full build relies on: the top layers fed
their cached inputs compute what the whole model computes (float64 reference), an expert differs
from the pretrained model only in the layers it trains, the head stays tied, the eval items are
templated, and the same seed gives the same bytes.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo.domains import DOMAIN_NAMES, make_splits
from demo.real_domains import REAL_DOMAINS
from demo.real_family import (
    END_OF_TURN,
    RealRecipe,
    build_real_family,
    chat,
    top_model,
)
from demo.smollm2 import smollm2_folder
from lm_eval_darts.leakage import CalibrationGrams

pytestmark = pytest.mark.real

SMALL = RealRecipe(trainable_layers=2, train_items=8, steps=2, batch=4, n_calib=4, n_eval=4)


@pytest.fixture(scope="module")
def two_builds(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("family")
    return [build_real_family(root / n, seed=0, progress=False, recipe=SMALL) for n in "ab"]


def test_the_top_layers_on_cached_inputs_compute_the_whole_models_output() -> None:
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    ids = tokenizer(
        [chat(tokenizer, 'What does this Python code print?\nprint("a", "b")')],
        return_tensors="pt",
        add_special_tokens=False,
    )["input_ids"]
    layers = 3
    with torch.no_grad():
        out = model.model(ids, output_hidden_states=True)
        cached = out.hidden_states[model.config.num_hidden_layers - layers]
        top = top_model(model, layers).double().eval()
        mine = top(inputs_embeds=cached).last_hidden_state
    torch.testing.assert_close(mine, out.last_hidden_state, rtol=0, atol=1e-10)


def test_an_expert_differs_from_the_pretrained_model_only_in_what_it_trains(two_builds) -> None:
    family = two_builds[0]
    base = load_file(family.base / "model.safetensors")
    trained = {f"model.layers.{i}." for i in (28, 29)} | {"model.norm."}
    for domain in DOMAIN_NAMES:
        expert = load_file(family.experts[domain] / "model.safetensors")
        assert set(expert) == set(base)  # tied: no lm_head.weight of its own
        moved = {k for k in base if not torch.equal(base[k], expert[k])}
        assert moved, f"{domain}: nothing trained"
        assert all(any(k.startswith(p) for p in trained) for k in moved), moved
        config = json.loads((family.experts[domain] / "config.json").read_text())
        assert config["tie_word_embeddings"] is True


def test_the_same_seed_builds_the_same_bytes(two_builds) -> None:
    a, b = two_builds
    for domain in DOMAIN_NAMES:
        one = (a.experts[domain] / "model.safetensors").read_bytes()
        assert one == (b.experts[domain] / "model.safetensors").read_bytes(), domain


def test_eval_items_are_templated_and_generation_stops_at_the_end_of_turn(two_builds) -> None:
    family = two_builds[0]
    for domain in DOMAIN_NAMES:
        items = [json.loads(x) for x in family.eval_file(domain).read_text().splitlines()]
        assert len(items) == SMALL.n_eval
        assert all(x["prompt"].endswith("<|im_start|>assistant\n") for x in items)
        assert all(x["prompt"].startswith("<|im_start|>system\n<|im_end|>") for x in items)
        task = yaml.safe_load((family.tasks / f"demo_{domain}.yaml").read_text())
        assert task["generation_kwargs"]["until"] == [END_OF_TURN]


@pytest.mark.parametrize("seed", [0, 1])
def test_the_leakage_check_tells_evaluation_from_calibration_prompts(seed: int) -> None:
    """The domains' templated prompts share a frame longer than 13 tokens: hf-darts' leakage
    check must flag every calibration prompt and none of the disjoint evaluation prompts (on
    family seed 0 it flagged 21-24 of 50 before the frame's ends were cut off)."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    special = set(tokenizer.all_special_ids)

    def ids(examples) -> list[list[int]]:
        texts = [chat(tokenizer, ex.prompt) for ex in examples]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [[t for t in row if t not in special] for row in encoded]

    for domain in DOMAIN_NAMES:
        splits = make_splits(domain, seed, 50, 50, REAL_DOMAINS)
        grams = CalibrationGrams(ids(splits.calib))
        assert all(grams.found_in(row) for row in ids(splits.calib)), domain
        assert not any(grams.found_in(row) for row in ids(splits.eval)), domain
