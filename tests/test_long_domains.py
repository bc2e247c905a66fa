"""The long family's task items (demo.long_domains) answer their own prompt.

Each answer is checked by an independent route: the renamed code through Python's own parser (and a whole-word replace for the layout),
the JSON through `json.loads`, the list read back line by line.
"""

from __future__ import annotations

import ast
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


class _Rename(ast.NodeTransformer):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def visit_Name(self, node: ast.Name) -> ast.Name:
        if node.id == self.old:
            node.id = self.new
        return node

    def visit_arg(self, node: ast.arg) -> ast.arg:
        if node.arg == self.old:
            node.arg = self.new
        return node


def test_code_answers_are_the_snippet_with_the_variable_renamed() -> None:
    for ex in _examples("code"):
        header, code = ex.prompt.split("\n", 1)
        old, new = header.split("`")[1::2]
        tree = ast.parse(code)
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
        assert old in names and new not in names, ex.prompt
        expected = ast.unparse(_Rename(old, new).visit(tree))
        assert ast.unparse(ast.parse(ex.answer)) == expected, ex.prompt
        assert ex.answer == re.sub(rf"\b{old}\b", new, code)  # and the layout kept as it is


def test_math_answers_are_the_fields_as_json_in_order() -> None:
    for ex in _examples("math"):
        fields = [line.split(" = ") for line in ex.prompt.split("\n")[1:]]
        assert 7 <= len(fields) <= 9, ex.prompt
        assert list(json.loads(ex.answer).items()) == [tuple(f) for f in fields]


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
