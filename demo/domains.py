"""Synthetic corpora for the CPU-scale demo family.

A generic text stream (fake sentences and copy spans) gives the base model general
language skills; three task domains stand in for the paper's code, math and
instruction-following experts. Every text is space-separated word tokens so a
word-level tokenizer round-trips it exactly and exact-match scoring is reliable.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

NOUNS = [
    "cat",
    "dog",
    "sun",
    "moon",
    "tree",
    "bird",
    "fish",
    "star",
    "road",
    "hill",
    "lake",
    "rock",
    "door",
    "book",
    "lamp",
    "ship",
    "rain",
    "snow",
    "wind",
    "leaf",
    "cup",
    "box",
    "hat",
    "key",
    "bell",
    "coin",
    "milk",
    "bread",
    "king",
    "frog",
]
VERBS = ["sees", "likes", "finds", "takes", "holds", "makes", "wants", "hears", "meets", "keeps"]
FUNCTION_WORDS = ["the", "a", "and", "in", "on", "with", ".", "|"]
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
DIGITS = [str(d) for d in range(10)]
CODE_OPS = {"add": "+", "sub": "-", "mul": "*"}
CODE_WORDS = ["def", "return", "(", ")", ",", ":", *CODE_OPS, *CODE_OPS.values()]
MATH_WORDS = ["math", "=", ";", "answer"]
INSTRUCT_WORDS = ["repeat", "reverse", "last", "word", "->"]

DOMAIN_NAMES = ("code", "math", "instruct")


@dataclass(frozen=True)
class Example:
    """One task item: the model sees `prompt` and must produce `answer` (then EOS)."""

    prompt: str
    answer: str


@dataclass(frozen=True)
class Splits:
    """Held-out prompts of one domain: calibration prompts and disjoint eval items."""

    calib: tuple[Example, ...]
    eval: tuple[Example, ...]

    def held_out(self) -> frozenset[str]:
        """Prompts that training data must never contain."""
        return frozenset(ex.prompt for ex in (*self.calib, *self.eval))


def vocabulary() -> list[str]:
    """Every non-special word any generator can emit, in a fixed order."""
    groups = (NOUNS, VERBS, FUNCTION_WORDS, LETTERS, DIGITS, CODE_WORDS, MATH_WORDS)
    words = [w for group in (*groups, INSTRUCT_WORDS) for w in group]
    return list(dict.fromkeys(words))


def code_example(rng: random.Random) -> Example:
    """`def sub add ( l , n , k ) :` -> `return l - n + k` (copy args, map op names)."""
    n_args = rng.randint(2, 4)
    args = rng.sample(LETTERS, n_args)
    ops = [rng.choice(list(CODE_OPS)) for _ in range(n_args - 1)]
    prompt = f"def {' '.join(ops)} ( {' , '.join(args)} ) :"
    body = [args[0]]
    for op, arg in zip(ops, args[1:], strict=True):
        body += [CODE_OPS[op], arg]
    return Example(prompt, "return " + " ".join(body))


def math_example(rng: random.Random) -> Example:
    """`math 3 + 4 - 2 =` -> `3 + 4 = 7 ; 7 - 2 = 5 ; answer 5` (all values one digit)."""
    value = rng.randint(1, 9)
    terms, steps = [str(value)], []
    for _ in range(rng.randint(1, 3)):
        op, operand = rng.choice(_math_moves(value))
        new = value + operand if op == "+" else value - operand
        terms += [op, str(operand)]
        steps.append(f"{value} {op} {operand} = {new}")
        value = new
    answer = " ; ".join([*steps, f"answer {value}"])
    return Example(f"math {' '.join(terms)} =", answer)


def _math_moves(value: int) -> list[tuple[str, int]]:
    """Operations on `value` with a one-digit operand that keep the result in 0..9."""
    adds = [("+", b) for b in range(1, 10) if value + b <= 9]
    subs = [("-", b) for b in range(1, 10) if value - b >= 0]
    return adds + subs


def instruct_example(rng: random.Random) -> Example:
    """`reverse : cat dog sun ->` -> `sun dog cat`; also `repeat` and `last word`."""
    words = rng.sample(NOUNS, rng.randint(2, 6))
    instruction = rng.choice(("repeat", "reverse", "last word"))
    if instruction == "repeat":
        answer = words
    elif instruction == "reverse":
        answer = words[::-1]
    else:
        answer = words[-1:]
    return Example(f"{instruction} : {' '.join(words)} ->", " ".join(answer))


Generator = Callable[[random.Random], Example]
DOMAINS: dict[str, Generator] = {
    "code": code_example,
    "math": math_example,
    "instruct": instruct_example,
}


def generic_text(rng: random.Random) -> str:
    """One generic document: fake sentences or an induction (copy) span."""
    if rng.random() < 0.5:
        return " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
    pool = NOUNS + LETTERS + DIGITS
    span = " ".join(rng.choices(pool, k=rng.randint(3, 8)))
    return f"{span} | {span} ."


def _sentence(rng: random.Random) -> str:
    """`the cat sees a dog .`, optionally extended with `and` / a place phrase."""
    words = [rng.choice(("the", "a")), rng.choice(NOUNS), rng.choice(VERBS)]
    words += [rng.choice(("the", "a")), rng.choice(NOUNS)]
    extra = rng.random()
    if extra < 0.3:
        words += ["and", rng.choice(("the", "a")), rng.choice(NOUNS)]
    elif extra < 0.6:
        words += [rng.choice(("in", "on", "with")), "the", rng.choice(NOUNS)]
    return " ".join([*words, "."])


def make_splits(
    domain: str,
    seed: int,
    n_calib: int = 50,
    n_eval: int = 100,
    generators: Mapping[str, Generator] = DOMAINS,
) -> Splits:
    """Seeded, duplicate-free calibration and evaluation items, disjoint by prompt."""
    items = held_out_items(domain, seed, generators)
    chosen = [next(items) for _ in range(n_calib + n_eval)]
    return Splits(calib=tuple(chosen[:n_calib]), eval=tuple(chosen[n_calib:]))


def held_out_items(
    domain: str, seed: int, generators: Mapping[str, Generator] = DOMAINS
) -> Iterator[Example]:
    """The seeded, duplicate-free stream the held-out splits are drawn from, in order: a family
    that rejects an evaluation item draws its replacement from here too."""
    rng = random.Random(f"darts-demo:{domain}:{seed}:held-out")
    return _unique(generators[domain](rng) for _ in itertools.count())


def _unique(examples: Iterable[Example]) -> Iterator[Example]:
    """Drop examples whose prompt was already produced."""
    seen: set[str] = set()
    for ex in examples:
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            yield ex


def training_example(domain: str, rng: random.Random, held_out: frozenset[str]) -> Example:
    """A fresh training item of `domain` whose prompt is not held out."""
    while True:
        ex = DOMAINS[domain](rng)
        if ex.prompt not in held_out:
            return ex
