"""The long-answer SmolLM2 family (`--scale long`, demo.long_domains), marker `real`.

Its answers run past 48 tokens, so what the build relies on is checked where the sequences are
long and of unequal length: the top layers fed their cached inputs (right-padded batches of
prompt + answer) compute what the whole model computes on each item alone (float64 reference);
each training item's loss ends on the end-of-turn token; the evaluation items are templated and
their generation stops at the end-of-turn token with room for the longest answer; the same seed
builds the same bytes.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo.domains import DOMAIN_NAMES, make_splits
from demo.long_domains import LONG_DOMAINS
from demo.real_family import (
    END_OF_TURN,
    SCALES,
    RealRecipe,
    build_real_family,
    cached_batches,
    chat,
    disjoint_splits,
    top_model,
    training_items,
)
from demo.smollm2 import smollm2_folder
from lm_eval_darts.leakage import CalibrationGrams

pytestmark = pytest.mark.real

SMALL = RealRecipe(trainable_layers=2, train_items=4, steps=2, batch=4, n_calib=4, n_eval=4)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_folder())


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("long")
    return build_real_family(root, seed=0, progress=False, recipe=SMALL, scale="long")


def test_the_same_seed_builds_the_same_bytes(family, tmp_path) -> None:
    """A second build of the long scale, seed 0: its experts and data files equal the first's."""
    again = build_real_family(tmp_path, seed=0, progress=False, recipe=SMALL, scale="long")
    for domain in DOMAIN_NAMES:
        weights = [f.experts[domain] / "model.safetensors" for f in (family, again)]
        assert weights[0].read_bytes() == weights[1].read_bytes(), domain
        for path in (family.calib_file(domain), family.eval_file(domain)):
            assert path.read_bytes() == (again.data / path.name).read_bytes(), path.name


def _items(domain: str) -> list:
    return training_items(random.Random(domain), domain, 3, frozenset(), LONG_DOMAINS)


def test_the_top_layers_on_cached_long_batches_compute_the_whole_models_output(tokenizer) -> None:
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float64).eval()
    layers = 3
    recipe = RealRecipe(trainable_layers=layers, batch=3)
    top = top_model(model, layers).double().eval()
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    for domain in DOMAIN_NAMES:
        items = _items(domain)
        [(hidden, labels)] = cached_batches(model, tokenizer, items, recipe)
        with torch.no_grad():
            batched = top(inputs_embeds=hidden).last_hidden_state
        lengths = set()
        for row, ex in enumerate(items):
            prompt = chat(tokenizer, ex.prompt)
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            ids += tokenizer(ex.answer, add_special_tokens=False)["input_ids"] + [eot]
            lengths.add(len(ids))
            with torch.no_grad():
                alone = model.model(torch.tensor([ids])).last_hidden_state[0]
            torch.testing.assert_close(batched[row, : len(ids)], alone, rtol=0, atol=1e-10)
            answer = labels[row][labels[row] != -100]
            assert len(answer) >= 40 and answer[-1].item() == eot, domain
        assert len(lengths) > 1, f"{domain}: the batch needs padding to check it"


def test_eval_items_are_templated_and_generation_stops_at_the_end_of_turn(
    family, tokenizer
) -> None:
    spec = SCALES["long"]
    for domain in DOMAIN_NAMES:
        items = [json.loads(x) for x in family.eval_file(domain).read_text().splitlines()]
        assert len(items) == SMALL.n_eval
        assert all(x["prompt"].startswith("<|im_start|>system\n<|im_end|>") for x in items)
        assert all(x["prompt"].endswith("<|im_start|>assistant\n") for x in items)
        task = yaml.safe_load((family.tasks / f"demo_{domain}.yaml").read_text())
        assert task["generation_kwargs"]["until"] == [END_OF_TURN]
        assert task["generation_kwargs"]["max_gen_toks"] == spec.max_gen_toks
        # every answer and its end-of-turn fit the generation limit (the whole split, seed 0)
        splits = disjoint_splits(tokenizer, domain, 0, spec.recipe, LONG_DOMAINS)
        for ex in (*splits.calib, *splits.eval):
            answer = tokenizer(ex.answer, add_special_tokens=False)["input_ids"]
            assert len(answer) + 1 <= spec.max_gen_toks, (domain, len(answer))
    stamp = json.loads(family.stamp.read_text())
    assert stamp["scale"] == "long"


@pytest.mark.parametrize(("domain", "seed"), [(d, s) for s in (0, 1) for d in DOMAIN_NAMES])
def test_the_leakage_check_tells_evaluation_from_calibration_prompts(
    domain: str, seed: int, tokenizer
) -> None:
    """The long prompts share a frame too: hf-darts' leakage check must flag every calibration
    prompt and none of the evaluation prompts the build writes (seed 0's math stream holds one
    that repeats four numbers in a row of a calibration prompt, 13 tokens: the build replaces
    it)."""
    special = set(tokenizer.all_special_ids)

    def ids(examples) -> list[list[int]]:
        texts = [chat(tokenizer, ex.prompt) for ex in examples]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [[t for t in row if t not in special] for row in encoded]

    splits = disjoint_splits(tokenizer, domain, seed, SCALES["long"].recipe, LONG_DOMAINS)
    assert (len(splits.calib), len(splits.eval)) == (50, 50)
    assert len(splits.held_out()) == 100
    grams = CalibrationGrams(ids(splits.calib))
    assert all(grams.found_in(row) for row in ids(splits.calib))
    assert not any(grams.found_in(row) for row in ids(splits.eval))


def test_the_build_replaces_only_the_evaluation_items_the_leakage_rule_flags(tokenizer) -> None:
    """The real scale's items stay as they were (its build identity too); the long scale's seed-0
    math split loses its one flagged item (the sixth) to the stream's next one, order kept."""
    for scale, spec in SCALES.items():
        for domain in DOMAIN_NAMES:
            n_calib, n_eval = spec.recipe.n_calib, spec.recipe.n_eval
            plain = make_splits(domain, 0, n_calib, n_eval + 1, spec.domains)
            built = disjoint_splits(tokenizer, domain, 0, spec.recipe, spec.domains)
            assert built.calib == plain.calib, (scale, domain)
            if (scale, domain) == ("long", "math"):
                assert built.eval == plain.eval[:5] + plain.eval[6:], domain
            else:
                assert built.eval == plain.eval[:n_eval], (scale, domain)
