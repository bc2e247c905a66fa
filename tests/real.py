"""A merge of the real SmolLM2-135M-Instruct with one routed surgery block, for the `real` tests.

The "experts" are the pretrained model with seeded noise on the MLP output projections of its top
layers (no training: these tests check plumbing and numbers on a real checkpoint, not what
surgery wins). They are merged by the stock ``mergekit-yaml`` (task arithmetic) with a surgery
block: ``math`` (pos_corr) and ``code`` (standard), calibrated on prompts through the model's own
chat template, routed with generic background. Used by tests/test_real.py and
tests_vllm/test_vllm_real.py.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file
from tiny import routed_merge_recipe

from demo.smollm2 import smollm2_folder

BIN = Path(sys.executable).parent
PERTURBED_LAYERS = range(26, 30)  # of 30
NOISE = 0.3  # times each perturbed matrix's own standard deviation
KINDS = {"math": "pos_corr", "code": "standard"}
RANK, MAX_POSITIONS = 8, 64  # test prompts run past 64 tokens: b_p = 0 there is exercised
WEIGHT = 0.5  # task arithmetic weight of each expert (tiny.routed_merge_recipe's)
N_PROMPTS = 16  # calibration prompts per task and of background


def _math(rng: random.Random) -> str:
    return f"What is {rng.randint(10, 99)} {rng.choice('+-')} {rng.randint(10, 99)}?"


def _code(rng: random.Random) -> str:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"What does this print? x = {a}; print(x * {b})"


def _general(rng: random.Random) -> str:
    subject = rng.choice(["the sun", "a river", "old castles", "winter", "the ocean", "bees"])
    return f"Write one sentence about {subject}."


PROMPTS = {"math": _math, "code": _code, "general": _general}


@dataclass(frozen=True)
class RealMerge:
    base: Path
    experts: dict[str, Path]
    merged: Path  # the merge with its surgery/ folder
    prompts: dict[str, list[str]]  # calibration prompts per task (and "general": background)


def perturbed_expert(base: Path, dest: Path, seed: int) -> Path:
    """``base`` with seeded noise on the top layers' ``mlp.down_proj``: every other tensor, the
    tokenizer, chat template and configs are the base's own."""
    shutil.copytree(base, dest, ignore=shutil.ignore_patterns("*.safetensors", "converted.json"))
    tensors = load_file(base / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for layer in PERTURBED_LAYERS:
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        w = tensors[name]
        tensors[name] = w + NOISE * w.std() * torch.randn(w.shape, generator=generator)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def build_real_merge(root: Path) -> RealMerge:
    """Experts, calibration files, the merge YAML and one stock ``mergekit-yaml`` run."""
    base = smollm2_folder()
    experts = {
        name: perturbed_expert(base, root / name, seed) for seed, name in enumerate(KINDS, 1)
    }
    rng = random.Random(0)
    prompts = {name: [make(rng) for _ in range(N_PROMPTS)] for name, make in PROMPTS.items()}
    for name, lines in prompts.items():
        text = "".join(json.dumps({"text": t}) + "\n" for t in lines)
        (root / f"{name}.jsonl").write_text(text)
    calibration = {
        "field": "text",
        "chat_template": True,
        "max_length": 64,
        "num_samples": N_PROMPTS,
    }
    surgery = dict(steps=40, lr=1e-2, rank=RANK, max_positions=MAX_POSITIONS)
    recipe = routed_merge_recipe(base, root, KINDS, calibration, cache_dtype="float32", **surgery)
    (root / "merge.yml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    merged = root / "merged"
    subprocess.run([BIN / "mergekit-yaml", root / "merge.yml", merged], check=True)
    return RealMerge(base, experts, merged, prompts)


def chat(tokenizer, prompt: str) -> str:
    """One user turn and the generation prompt, through the model's own chat template."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
