"""The long family's task items (demo.long_domains) answer their own prompt.

Each answer is checked by an independent route: the JSON through `json.loads`, the numbers and
the list read back out of the prompt and line by line.
"""

from __future__ import annotations

import json
import random
import re

from demo.domains import make_splits
from demo.long_domains import LONG_DOMAINS
from demo.real_family import training_items

N = 200


def _examples(domain: str):
    rng = random.Random(f"test:{domain}")
    return [LONG_DOMAINS[domain](rng) for _ in range(N)]


def test_code_answers_are_the_fields_as_json_in_order() -> None:
    for ex in _examples("code"):
        fields = [line.split(" = ") for line in ex.prompt.split("\n")[1:]]
        assert 7 <= len(fields) <= 9, ex.prompt
        assert list(json.loads(ex.answer).items()) == [tuple(f) for f in fields]


def test_math_answers_are_the_numbers_one_per_line() -> None:
    for ex in _examples("math"):
        numbers = [int(n) for n in re.findall(r"\d+", ex.prompt)]
        assert 16 <= len(numbers) <= 20 and len(set(numbers)) == len(numbers), ex.prompt
        assert [int(line) for line in ex.answer.split("\n")] == numbers


def test_instruct_answers_are_the_list_one_item_per_line() -> None:
    for ex in _examples("instruct"):
        items = ex.prompt.rsplit(": ", 1)[1].split(", ")
        assert 15 <= len(items) <= 19, ex.prompt
        assert ex.answer.split("\n") == [f"- {w}" for w in items]


def test_splits_and_training_items_are_disjoint_by_prompt() -> None:
    for domain in LONG_DOMAINS:
        splits = make_splits(domain, 0, 50, 50, LONG_DOMAINS)
        held = splits.held_out()
        assert len(held) == 100
        train = training_items(random.Random(domain), domain, 192, held, LONG_DOMAINS)
        assert len({ex.prompt for ex in train}) == 192
        assert not held & {ex.prompt for ex in train}
