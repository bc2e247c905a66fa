"""``mergekit-darts report``: the options of ``analysis.report.report_command``, imported on run.

A stand-in so that ``report --help`` needs no matplotlib or torch.
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
    from mergekit_darts.analysis.report import report_command

    report_command.callback(merged, output, recompute, quiet)
