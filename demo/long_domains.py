"""The three task domains of the long-answer SmolLM2 family (`--scale long`): long, deterministic
answers.

The real family answers in a few tokens, so a merge's per-position bias has no late positions to
act on. Here every answer is a copy of the prompt's content with a transformation (one word per
line, fields as JSON, a code snippet with one variable renamed): a median of 50-55 tokens, one
exact string, scored whole. The pretrained model answers with prose or another layout (exact match
0 %); an expert fine-tuned on the top layers learns the layout. The domains were chosen by the
probes in docs/real-model.md (a numbered list, a templated item list and a Markdown table from CSV
lost or skipped items too often after top-layer fine-tuning). The names are the tiny demo's
(`code`, `math`, `instruct`), so the driver, configs and report serve every family.
"""

from __future__ import annotations

import random

from demo.domains import Example
from demo.real_domains import WORDS

KEYS = ("name", "colour", "city", "animal", "fruit", "tool", "metal", "season", "shape", "sport")
# function bodies: {f} the function, {p} {q} its parameters, {v} {w} its local variables
SNIPPETS = (
    "def {f}({p}, {q}):\n    {v} = {p} + {q}\n    {w} = {v} * 2\n    if {w} > {q}:\n"
    "        {v} = {w} - {p}\n        return {w}\n    print({p}, {v})\n    {w} = {v} + {q}\n"
    "    return {w}",
    "def {f}({p}, {q}):\n    {v} = 0\n    for {w} in {p}:\n        {v} = {v} + {w}\n"
    "        if {v} > {q}:\n            break\n    print({v}, {q})\n    {v} = {v} - {q}\n"
    "    return {v}",
    "def {f}({p}, {q}):\n    {w} = []\n    for {v} in {p}:\n        if {v} != {q}:\n"
    "            {w}.append({v})\n        else:\n            print({v})\n    {w}.sort()\n"
    "    return {w}",
)


def code_example(rng: random.Random) -> Example:
    """A nine-line function with one of its parameters or local variables renamed."""
    f, p, q, v, w, new = rng.sample(WORDS, 6)
    names = {"f": f, "p": p, "q": q, "v": v, "w": w}
    snippet = rng.choice(SNIPPETS)
    renamed = rng.choice("pqvw")
    prompt = f"Rename the variable `{names[renamed]}` to `{new}` in this code:\n"
    return Example(prompt + snippet.format(**names), snippet.format(**{**names, renamed: new}))


def math_example(rng: random.Random) -> Example:
    """Seven to nine `key = value` lines as one JSON object, keys in the given order."""
    keys = rng.sample(KEYS, rng.randint(7, 9))
    values = rng.sample(WORDS, len(keys))
    fields = "\n".join(f"{k} = {v}" for k, v in zip(keys, values, strict=True))
    body = ", ".join(f'"{k}": "{v}"' for k, v in zip(keys, values, strict=True))
    return Example(f"Rewrite these fields as a JSON object:\n{fields}", "{" + body + "}")


def instruct_example(rng: random.Random) -> Example:
    """A comma-separated list of 15-19 words, one word per line after a dash."""
    words = rng.sample(WORDS, rng.randint(15, 19))
    prompt = "Write the items of this list one per line, each after a dash: " + ", ".join(words)
    return Example(prompt, "\n".join(f"- {w}" for w in words))


LONG_DOMAINS = {"code": code_example, "math": math_example, "instruct": instruct_example}
