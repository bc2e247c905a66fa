"""The three task domains of the long-answer SmolLM2 family (`--scale long`): long, deterministic
answers.

The real family answers in a few tokens, so a merge's per-position bias has no late positions to
act on. Here every answer copies the prompt's content into another layout (fields as one JSON
object, numbers one per line, words one per line after a dash): a median of about 54 tokens, one
exact string, scored whole. The pretrained model answers with prose or another layout (exact match
0 %); an expert fine-tuned on the top layers learns the layout. The domains were chosen by the
probes in docs/real-model.md: copying that skips or invents an item fails the whole answer, and a
numbered list, a templated item list, a Markdown table from CSV and a renamed variable in code
failed too often after top-layer fine-tuning. The names are the tiny demo's (`code`, `math`,
`instruct`), so the driver, configs and report serve every family.
"""

from __future__ import annotations

import random

from demo.domains import Example
from demo.real_domains import WORDS

KEYS = ("name", "colour", "city", "animal", "fruit", "tool", "metal", "season", "shape", "sport")


def code_example(rng: random.Random) -> Example:
    """Seven to nine `key = value` lines as one JSON object, keys in the given order."""
    keys = rng.sample(KEYS, rng.randint(7, 9))
    values = rng.sample(WORDS, len(keys))
    fields = "\n".join(f"{k} = {v}" for k, v in zip(keys, values, strict=True))
    body = ", ".join(f'"{k}": "{v}"' for k, v in zip(keys, values, strict=True))
    return Example(f"Rewrite these fields as a JSON object:\n{fields}", "{" + body + "}")


def math_example(rng: random.Random) -> Example:
    """16-20 different two-digit numbers, comma-separated, written one per line."""
    numbers = [str(n) for n in rng.sample(range(10, 100), rng.randint(16, 20))]
    prompt = "Write these numbers one per line: " + ", ".join(numbers)
    return Example(prompt, "\n".join(numbers))


def instruct_example(rng: random.Random) -> Example:
    """A comma-separated list of 15-19 words, one word per line after a dash."""
    words = rng.sample(WORDS, rng.randint(15, 19))
    prompt = "Write the items of this list one per line, each after a dash: " + ", ".join(words)
    return Example(prompt, "\n".join(f"- {w}" for w in words))


LONG_DOMAINS = {"code": code_example, "math": math_example, "instruct": instruct_example}
