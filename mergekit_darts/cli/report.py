"""``mergekit-darts report``: the options, then :func:`mergekit_darts.present.report.write_report`.

The library is imported inside the command, so ``--help`` imports no torch or matplotlib.
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command("report")
@click.argument("merged", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for the report (default: MERGED/surgery/report).",
)
@click.option(
    "--recompute",
    is_flag=True,
    help="Recompute δ_t and entropy on the calibration set (loads every target, then the merge).",
)
@click.option("--quiet", is_flag=True, help="No progress bars.")
def command(merged: Path, output: Path | None, recompute: bool, quiet: bool) -> None:
    """Write a markdown + HTML report of MERGED/surgery with plots (paper Figure 1 and more)."""
    from mergekit_darts.hosts.click_errors import one_line_errors
    from mergekit_darts.present.report import write_report

    with one_line_errors():
        path = write_report(
            merged, output=output, recompute_diagnostics=recompute, progress=not quiet
        )
    click.echo(f"wrote {path} and {path.with_suffix('.html')}")
