"""``mergekit-darts stats``: options, then :func:`mergekit_darts.analysis.comparison.write_stats`.

The library is imported inside the command, so ``--help`` imports no scipy.
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command("stats")
@click.argument("results_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--a", "a", required=True, help="Configuration a, e.g. module=pos_corr,loss=ewl1.")
@click.option("--b", "b", required=True, help="Configuration b, e.g. module=standard,loss=l1.")
@click.option(
    "--unit",
    type=click.Choice(["seed", "item"]),
    default="seed",
    show_default=True,
    help="Pair seeds (paper Tables 4, 15) or individual evaluation items.",
)
def command(results_dir: Path, a: str, b: str, unit: str) -> None:
    """Paired t / Wilcoxon tests of a vs b and the rho_L1-score correlation of a sweep."""
    from mergekit_darts.analysis.comparison import write_stats
    from mergekit_darts.hosts.click_errors import one_line_errors

    with one_line_errors():
        markdown, path = write_stats(results_dir, a, b, unit)
    click.echo(markdown)
    click.echo(f"wrote {path} and stats.json")
