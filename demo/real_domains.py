"""The three task domains of the real family (SmolLM2-135M-Instruct experts): short user turns.

Each answer is a few tokens that exact match can score. The pretrained instruct model answers in
sentences (exact match near 0 %), often with the right value inside; an expert fine-tuned on the
domain answers with the bare value. The domains were chosen for what fine-tuning the top layers
learns in tens of steps on CPU (the probes in docs/real-model.md: a two-variable lookup, a
number from the end of a list, a small sum and a counted repetition stayed below 60 %). The names are the tiny demo's (`code`, `math`,
`instruct`), so the driver, configs and report serve both families.
"""

from __future__ import annotations

import random

from demo.domains import Example

WORDS = (
    "apple river stone cloud green tiger piano candle garden window rocket silver forest honey "
    "mirror pencil island winter summer bread castle dragon orange planet ladder basket violin "
    "rabbit wagon meadow lemon horse chair paper table spoon pillow bottle button camera cotton "
    "desert engine feather glass hammer jacket kettle lantern marble needle ocean pepper puzzle "
    "rainbow saddle shadow statue thunder tunnel"
).split()


def code_example(rng: random.Random) -> Example:
    """What `print` with two string arguments writes: the two strings, one space between."""
    first, second = rng.sample(WORDS, 2)
    prompt = f'What does this Python code print?\nprint("{first}", "{second}")'
    return Example(prompt, f"{first} {second}")


def math_example(rng: random.Random) -> Example:
    """The larger of two different two-digit numbers."""
    a, b = rng.sample(range(10, 100), 2)
    return Example(f"Which number is larger, {a} or {b}?", str(max(a, b)))


def instruct_example(rng: random.Random) -> Example:
    """A format instruction: only the first word of a five-word sentence."""
    words = rng.sample(WORDS, 5)
    return Example(f"What is the first word of this sentence: {' '.join(words)}", words[0])


REAL_DOMAINS = {"code": code_example, "math": math_example, "instruct": instruct_example}
