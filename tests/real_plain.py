"""A real SmolLM2-135M-Instruct merge whose task keeps a fitted plain ``head`` correction, and the
plain folder ``mergekit-darts export`` writes from it, for the GGUF and llama.cpp tests.

The expert is tests/real.py's: the pretrained model with seeded noise on its top layers' MLP
output projections. The stock ``mergekit-yaml`` merges it with the base by task arithmetic, with
a surgery block of one task, ``module: head`` (no selection: the closed-form fit is kept),
calibrated on chat-templated arithmetic prompts. The merge keeps SmolLM2's tied head, so the
export unties it into its own ``lm_head.weight``.
"""

from __future__ import annotations

import json
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml
from real import BIN, N_PROMPTS, PROMPTS, WEIGHT, perturbed_expert
from tiny import surgery_block

from demo.smollm2 import smollm2_folder

TASK = "math"
CALIBRATION = {"field": "text", "chat_template": True, "max_length": 64, "num_samples": N_PROMPTS}


@dataclass(frozen=True)
class PlainMerge:
    merged: Path  # the merge with its surgery/ folder
    plain: Path  # its plain export of TASK
    prompts: list[str]  # held-out prompts of the task (not calibrated on)


def build_plain_merge(root: Path) -> PlainMerge:
    """Expert, calibration file, one ``mergekit-yaml`` run with the surgery block, the export."""
    base = smollm2_folder()
    expert = perturbed_expert(base, root / TASK, seed=1)
    rng = random.Random(0)
    lines = [json.dumps({"text": PROMPTS[TASK](rng)}) + "\n" for _ in range(N_PROMPTS)]
    (root / f"{TASK}.jsonl").write_text("".join(lines))
    held_out = [PROMPTS[TASK](random.Random(seed)) for seed in (101, 102)]
    held_out.append(PROMPTS["general"](random.Random(103)))
    block = surgery_block(
        expert, root / f"{TASK}.jsonl", name=TASK, field="text", calibration=CALIBRATION
    )
    block |= {"module": "head", "cache_dtype": "float32"}
    recipe = {
        "merge_method": "task_arithmetic",
        "base_model": str(base),
        "models": [{"model": str(expert), "parameters": {"weight": WEIGHT}}],
        "dtype": "float32",
        "surgery": block,
    }
    (root / "merge.yml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    merged = root / "merged"
    subprocess.run([BIN / "mergekit-yaml", root / "merge.yml", merged], check=True)
    plain = root / "plain"
    subprocess.run([BIN / "mergekit-darts", "export", merged, "--task", TASK, plain], check=True)
    return PlainMerge(merged, plain, held_out)
