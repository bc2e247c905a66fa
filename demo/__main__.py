"""`python -m demo`: the README's first command (`make demo`).

It first re-executes itself with the reproducibility pins (demo.pinning) when the
environment lacks them: they only act if set before torch starts, so nothing here imports torch
before that.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from demo.configs import METHODS  # no torch: configs builds YAML only
from demo.pinning import reexec_if_unpinned


@click.command()
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True
)
@click.option(
    "--scale",
    type=click.Choice(["full", "tiny", "real", "long"]),
    default="full",
    show_default=True,
    help="full/tiny: the tiny Llama family; real: SmolLM2-135M-Instruct experts (make demo-real); "
    "long: SmolLM2 experts with 50-token answers.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Family and merge seed.")
@click.option(
    "--method",
    "methods",
    multiple=True,
    type=click.Choice(list(METHODS)),
    help="Repeatable; default: all four.",
)
@click.option("--steps", type=int, default=500, show_default=True, help="Surgery training steps.")
@click.option(
    "--surgery-seeds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Surgery seeds 0..N-1 per surgery row; intervals resample seeds and items.",
)
@click.option("--limit", type=int, default=None, help="Evaluation items per task (default: all).")
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--fresh", is_flag=True, help="Redo merges and evaluations even when cached.")
@click.option(
    "--full", is_flag=True, help="Also the ablation rows and the held-out-metric study (slower)."
)
def main(**options: Any) -> None:
    """Build the family, merge with surgery, evaluate, and print a CPU-scale Table 1."""
    from demo.run import DemoSettings, run_demo

    # every option is named as the DemoSettings field it sets
    run_demo(DemoSettings(**(options | {"methods": options["methods"] or tuple(METHODS)})))


if __name__ == "__main__":
    reexec_if_unpinned("demo", sys.argv[1:])
    main()
