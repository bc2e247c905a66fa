"""`python -m mergekit_darts.demo`: the README's first command (`make demo`)."""

from __future__ import annotations

from pathlib import Path

import click

from mergekit_darts.demo.configs import METHODS
from mergekit_darts.demo.run import DemoSettings, run_demo


@click.command()
@click.option(
    "--out", type=click.Path(path_type=Path), default=Path("runs/demo"), show_default=True
)
@click.option("--scale", type=click.Choice(["full", "tiny"]), default="full", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Family and merge seed.")
@click.option(
    "--method",
    "methods",
    multiple=True,
    type=click.Choice(list(METHODS)),
    help="Repeatable; default: all four.",
)
@click.option("--steps", type=int, default=500, show_default=True, help="Surgery training steps.")
@click.option("--limit", type=int, default=None, help="Evaluation items per task (default: all).")
@click.option("--batch-size", type=int, default=32, show_default=True)
@click.option("--fresh", is_flag=True, help="Redo merges and evaluations even when cached.")
def main(
    out: Path,
    scale: str,
    seed: int,
    methods: tuple[str, ...],
    steps: int,
    limit: int | None,
    batch_size: int,
    fresh: bool,
) -> None:
    """Build the tiny family, merge with surgery, evaluate, and print a CPU-scale Table 1."""
    run_demo(
        DemoSettings(out, scale, seed, methods or tuple(METHODS), steps, limit, batch_size, fresh)
    )


if __name__ == "__main__":
    main()
