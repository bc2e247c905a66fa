"""`route:` in the surgery block: every bad value is one line before any merge work."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tiny import merge_config, refuse

from mergekit_darts.config import parse_surgery, route_tasks


def route(**changes) -> Callable[[dict, Path], None]:
    """A mutation setting ``surgery.route`` (callable values get the odd-files folder)."""

    def mutate(config: dict, files: Path) -> None:
        config["surgery"]["route"] = {
            key: value(files) if callable(value) else value for key, value in changes.items()
        }

    return mutate


def background(**calibration) -> Callable[[Path], dict]:
    return lambda files: calibration


def one_task(config: dict, files: Path) -> None:
    config["surgery"]["tasks"] = config["surgery"]["tasks"][:1]
    config["surgery"]["route"] = {}


def few_prompts(config: dict, files: Path) -> None:
    config["surgery"]["tasks"][1]["calibration"]["num_samples"] = 1
    config["surgery"]["route"] = {"holdout": 0.2}
    config["surgery"]["select"] = "off"  # else the default selection's holdout is refused first


BAD_ROUTE = [
    ("one task", one_task, "surgery.route: a router weighs two or more tasks, the block has 1"),
    (
        "unknown route task",
        route(tasks=["math", "poetry"]),
        "surgery.route.tasks[1]: no task named 'poetry' in the block (it has math, code)",
    ),
    (
        "route task twice",
        route(tasks=["math", "math"]),
        "surgery.route.tasks[1]: task 'math' is listed twice",
    ),
    (
        "one route task",
        route(tasks=["code"]),
        "surgery.route.tasks: a router weighs two or more tasks, 1 named",
    ),
    ("unknown route key", route(temperature=2), "surgery.route.temperature: unknown key"),
    ("holdout of 1", route(holdout=1), "surgery.route.holdout: must be < 1"),
    ("negative l2", route(l2=-1), "surgery.route.l2: must be >= 0"),
    ("zero steps", route(steps=0), "surgery.route.steps: must be > 0"),
    (
        "background with two sources",
        route(background=background(path="a.jsonl", dataset="b", split="train")),
        "surgery.route.background: give exactly one source",
    ),
    (
        "background with an unknown key",
        route(background=background(path="a.jsonl", samples=3)),
        "surgery.route.background.samples: unknown key",
    ),
    (
        "background with completions",
        route(background=lambda files: {"path": str(files / "bg.jsonl"), "continuation_tokens": 4}),
        "surgery.route.background.continuation_tokens: background text is captured on the merged",
    ),
    (
        "background file missing",
        route(background=lambda files: {"path": str(files / "missing.jsonl")}),
        "surgery.route.background.path: no file at",
    ),
    (
        "background file empty",
        route(background=lambda files: {"path": str(files / "empty.jsonl")}),
        "surgery.route.background.path: ",
    ),
    (
        "background without the field",
        route(background=lambda files: {"path": str(files / "nofield.jsonl")}),
        "surgery.route.background.field: line 2 of",
    ),
    (
        "background of blank prompts",
        route(background=lambda files: {"path": str(files / "blank.jsonl")}),
        "surgery.route.background: ",
    ),
    (
        "background in a chat template the merge lacks",
        route(background=lambda files: {"path": str(files / "bg.jsonl"), "chat_template": True}),
        "surgery.route.background.chat_template: the base model",
    ),
    (
        "holdout leaving a task no prompt",
        few_prompts,
        "surgery.route.holdout: 0.2 of the 1 prompt(s) of task 'code' holds out 1",
    ),
    (
        "holdout leaving the background no prompt",
        route(background=lambda files: {"path": str(files / "one.jsonl")}),
        "surgery.route.holdout: 0.2 of the 1 prompt(s) of the background holds out 1",
    ),
]


@pytest.fixture
def odd_route(odd):
    (odd / "bg.jsonl").write_text('{"text": "the sun and the moon"}\n{"text": "red blue"}\n')
    (odd / "one.jsonl").write_text('{"text": "the sun and the moon"}\n')
    return odd


@pytest.mark.parametrize(
    ("mutate", "expected"), [c[1:] for c in BAD_ROUTE], ids=[c[0] for c in BAD_ROUTE]
)
def test_bad_route_is_one_line_before_merging(
    tiny_family, calibration_data, odd_route, tmp_path, mutate, expected
):
    config = merge_config(tiny_family, calibration_data)
    mutate(config, odd_route)
    message = refuse(config, tmp_path / "out")
    assert message.startswith(expected), message


def test_route_defaults_and_task_order():
    base = {"target": "t", "calibration": {"path": "p.jsonl"}}
    tasks = [{"name": n, **base} for n in ("code_std", "code_darts", "math")]
    config = parse_surgery({"route": {}, "tasks": tasks})
    assert route_tasks(config) == ["code_std", "code_darts", "math"]
    assert (config.route.holdout, config.route.l2, config.route.steps) == (0.2, 1e-3, 100)
    assert config.route.background is None
    picked = parse_surgery({"route": {"tasks": ["math", "code_darts"]}, "tasks": tasks})
    assert route_tasks(picked) == ["math", "code_darts"]
    assert route_tasks(parse_surgery({"tasks": tasks})) == []


def test_routed_tasks_may_train_on_completions():
    base = {"target": "t", "loss_positions": "completion"}
    cal = {"path": "p.jsonl", "continuation_tokens": 4, "max_length": 16}
    tasks = [{"name": n, **base, "calibration": cal} for n in ("a", "b")]
    assert route_tasks(parse_surgery({"route": {}, "tasks": tasks})) == ["a", "b"]
