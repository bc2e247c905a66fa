"""``mergekit-darts sweep``: the options, then :func:`mergekit_darts.analysis.sweep.run_spec_file`.

The library is imported inside the command, so ``--help`` imports no torch, lm-eval or plotting.
"""

from __future__ import annotations

from pathlib import Path

import click


@click.command("sweep")
@click.argument("spec_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--output", type=click.Path(path_type=Path), help="Overrides `output:` of the YAML.")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Capture store on disk (overrides the surgery block's cache_dir): a second sweep loads "
    "no target.",
)
def command(spec_path: Path, output: Path | None, cache_dir: Path | None) -> None:
    """Run an ablation grid of surgery settings on a merged model, or on a grid of merges.

    Finished cells are kept in OUTPUT/cells/<cell>/result.json and skipped when run again; a
    merge grid's merges are written to OUTPUT/merges/<yaml stem>/.
    """
    from mergekit_darts.analysis.sweep import run_spec_file
    from mergekit_darts.hosts.click_errors import one_line_errors

    with one_line_errors():
        written = run_spec_file(spec_path, output=output, cache_dir=cache_dir)
    click.echo(written["markdown"].read_text(encoding="utf-8"))
    click.echo("wrote " + ", ".join(str(p) for p in written.values()))
