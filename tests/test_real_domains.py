"""The real family's task items (demo.real_domains) answer their own prompt.

Each answer is checked by an independent route: the Python snippet is run, the numbers and the
sentence are read back out of the prompt text.
"""

from __future__ import annotations

import contextlib
import io
import random
import re

from demo.domains import make_splits
from demo.real_domains import REAL_DOMAINS
from demo.real_family import training_items

N = 200


def _examples(domain: str):
    rng = random.Random(f"test:{domain}")
    return [REAL_DOMAINS[domain](rng) for _ in range(N)]


def test_code_answers_are_what_python_prints() -> None:
    for ex in _examples("code"):
        snippet = ex.prompt.split("\n", 1)[1]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(snippet, {})  # our own generated two-string print, nothing else
        assert printed.getvalue() == ex.answer + "\n", ex.prompt


def test_math_answers_are_the_larger_number() -> None:
    for ex in _examples("math"):
        numbers = [int(n) for n in re.findall(r"\d+", ex.prompt)]
        assert len(numbers) == 2 and numbers[0] != numbers[1], ex.prompt
        assert ex.answer == str(max(numbers))


def test_instruct_answers_are_the_first_word_of_the_sentence() -> None:
    for ex in _examples("instruct"):
        sentence = ex.prompt.rsplit(":", 1)[1].split()
        assert len(sentence) >= 3 and ex.answer == sentence[0], ex.prompt


def test_splits_and_training_items_are_disjoint_by_prompt() -> None:
    for domain in REAL_DOMAINS:
        splits = make_splits(domain, 0, 50, 50, REAL_DOMAINS)
        calib = {ex.prompt for ex in splits.calib}
        held = splits.held_out()
        assert len(calib) == 50 and len({ex.prompt for ex in splits.eval}) == 50
        assert not calib & {ex.prompt for ex in splits.eval}
        train = training_items(random.Random(domain), domain, 192, held)
        assert len({ex.prompt for ex in train}) == 192
        assert not held & {ex.prompt for ex in train}
