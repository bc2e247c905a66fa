"""Defaults are named once (the block's schema, correction.spec) and read from there everywhere."""

from __future__ import annotations

import inspect

from mergekit_darts.calibrate.capture import capture
from mergekit_darts.calibrate.continuation import greedy_completions
from mergekit_darts.calibrate.train import TrainSettings
from mergekit_darts.config.schema import default
from mergekit_darts.messages import exponent_form


def test_capture_and_training_defaults_are_the_blocks() -> None:
    for function in (capture, greedy_completions):
        assert inspect.signature(function).parameters["batch_size"].default == default("batch_size")
    settings = TrainSettings()
    assert (settings.steps, settings.lr, settings.batch_size) == (
        default("steps"),
        default("lr"),
        default("batch_size"),
    )


def test_exponent_form_writes_a_rate_as_the_docs_do() -> None:
    assert [exponent_form(x) for x in (1e-3, 2.5e-4, 3e-5, 1.0)] == [
        "1e-3",
        "2.5e-4",
        "3e-5",
        "1e0",
    ]


def test_the_demo_trains_with_the_blocks_steps() -> None:
    """`python -m demo --steps` restates the default (it must not import torch before its pins)."""
    from demo.__main__ import main

    (steps,) = [p for p in main.params if p.name == "steps"]
    assert steps.default == default("steps")
