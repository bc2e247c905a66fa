"""Text from none of the tasks: what the router learns to leave alone, and how far corrections move it.

A routed model corrects every token by what its hidden state looks like, so generic text
(the family's own corpus, no task format) should get little correction. The router is fitted
with ``GENERIC_BACKGROUND`` prompts as its "none" class; ``logit_shift`` measures held-apart
generic prompts under ``surgery=routed`` and under each single module, against the plain merge.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from demo.configs import BACKGROUND_SAMPLES
from demo.domains import generic_text

N_MEASURED = 100  # generic prompts measured, disjoint from the background prompts
MAX_WORDS = 48  # generic documents are short; a cap keeps every prompt inside max_positions


def write_generic_prompts(folder: Path, seed: int) -> tuple[Path, Path]:
    """``generic_background.jsonl`` (the router's "none" class) and ``generic_measured.jsonl``
    (the logit-shift measurement), disjoint, seeded, in the `prompt` field."""
    rng = random.Random(f"darts-demo:generic:{seed}")
    seen: set[str] = set()
    prompts: list[str] = []
    while len(prompts) < BACKGROUND_SAMPLES + N_MEASURED:
        text = " ".join(generic_text(rng).split()[:MAX_WORDS])
        if text not in seen:
            seen.add(text)
            prompts.append(text)
    folder.mkdir(parents=True, exist_ok=True)
    background, measured = folder / "generic_background.jsonl", folder / "generic_measured.jsonl"
    for path, part in (
        (background, prompts[:BACKGROUND_SAMPLES]),
        (measured, prompts[BACKGROUND_SAMPLES:]),
    ):
        text = "".join(json.dumps({"prompt": p}) + "\n" for p in part)
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
    return background, measured


def logit_shift(merged: Path, prompts_file: Path, tasks: Sequence[str]) -> dict[str, Any]:
    """Per correction (``routed`` and each of ``tasks``): the mean KL(plain || corrected) per token
    in nats and the share of tokens whose top-1 prediction changes, over the measured prompts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mergekit_darts.apply import apply_surgery
    from mergekit_darts.folder.manifest import surgery_dir
    from mergekit_darts.task_map import ROUTED

    prompts = [json.loads(line)["prompt"] for line in prompts_file.read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(merged)
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    batches = [tokenizer(p, return_tensors="pt") for p in prompts]
    with torch.no_grad():
        plain = [torch.log_softmax(model(**b).logits[0].double(), -1) for b in batches]
        out: dict[str, Any] = {"prompts": len(prompts), "tokens": sum(p.shape[0] for p in plain)}
        for name in (ROUTED, *tasks):
            kl, changed = 0.0, 0
            with apply_surgery(model, surgery_dir(merged), task=name):
                for batch, reference in zip(batches, plain, strict=True):
                    corrected = torch.log_softmax(model(**batch).logits[0].double(), -1)
                    kl += float((reference.exp() * (reference - corrected)).sum())
                    changed += int((reference.argmax(-1) != corrected.argmax(-1)).sum())
            out[name] = {"kl": kl / out["tokens"], "top1_changed": 100.0 * changed / out["tokens"]}
    return out
