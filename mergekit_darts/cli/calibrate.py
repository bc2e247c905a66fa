"""``mergekit-darts calibrate``: add or redo the surgery of an already merged folder."""

from __future__ import annotations

import click


@click.command("calibrate")
@click.argument("out_path", type=click.Path(exists=True, file_okay=False))
@click.argument("surgery_yml", type=click.Path(exists=True, dir_okay=False))
@click.option("--overwrite", is_flag=True, help="Replace an existing OUT_PATH/surgery/ folder.")
@click.option("--quiet", is_flag=True, help="No progress bars and no summary table.")
@click.option(
    "--write-model-card/--no-write-model-card",
    default=True,
    show_default=True,
    help="Add the surgery section to OUT_PATH/README.md.",
)
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    help="Capture store on disk (overrides the block's cache_dir): a re-run loads no model "
    "whose captures are there.",
)
def command(
    out_path: str,
    surgery_yml: str,
    overwrite: bool,
    quiet: bool,
    write_model_card: bool,
    cache_dir: str | None,
) -> None:
    """Add (or with --overwrite redo) surgery on the merged folder OUT_PATH.

    SURGERY_YML is a merge YAML with a `surgery:` block, or the block alone.
    """
    from mergekit_darts.calibrate.store import CaptureStore
    from mergekit_darts.hosts.post_merge import run_surgery

    run_surgery(
        out_path,
        surgery_yml,
        overwrite=overwrite,
        progress=not quiet,
        write_card=write_model_card,
        store=CaptureStore(cache_dir) if cache_dir else None,
    )
