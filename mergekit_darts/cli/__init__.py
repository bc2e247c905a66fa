"""``mergekit-darts``: the explicit commands, usable without the startup hook.

``merge`` is ``mergekit-yaml`` (mergekit's own option decorator, so every stock flag is there)
plus the surgery; ``calibrate`` adds or redoes the surgery of an already merged folder; ``export``
writes a folder that plain transformers (and vLLM) load with the correction built in. More
subcommands attach to the ``main`` group.
"""

from __future__ import annotations

import inspect
from typing import Any

import click
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions, PrettyPrintHelp, add_merge_options

from mergekit_darts.cli.report import command as report_command
from mergekit_darts.cli.stats import command as stats_command
from mergekit_darts.cli.sweep import command as sweep_command
from mergekit_darts.deploy.export import LINKS
from mergekit_darts.integrations.click_errors import one_line_errors
from mergekit_darts.integrations.mergekit_hook import merge_with_surgery


class _Commands(click.Group):
    """The command group: a ``DartsError`` is shown as one line, like click's own errors."""

    def invoke(self, ctx: click.Context) -> Any:
        with one_line_errors():
            return super().invoke(ctx)


@click.group(cls=_Commands)
@click.version_option(package_name="mergekit-darts")
def main() -> None:
    """DARTS surgery for mergekit merges."""


@main.command("merge", cls=PrettyPrintHelp)
@click.argument("config_file", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_path")
@click.option(
    "--overwrite-surgery",
    is_flag=True,
    help="Replace an existing OUT_PATH/surgery/ folder instead of refusing.",
)
@add_merge_options
def merge(
    merge_options: MergeOptions, config_file: str, out_path: str, overwrite_surgery: bool
) -> None:
    """Merge CONFIG_FILE into OUT_PATH like mergekit-yaml, then run its `surgery:` block."""
    merge_options.apply_global_options()
    with open(config_file, encoding="utf-8") as file:
        config_source = file.read()
    merge_config = MergeConfiguration.model_validate(yaml.safe_load(config_source))
    from mergekit import merge as mergekit_merge

    stock = inspect.unwrap(mergekit_merge.run_merge)  # the hook may have wrapped it already
    merge_with_surgery(
        stock, merge_config, out_path, merge_options, config_source, overwrite=overwrite_surgery
    )


@main.command("calibrate")
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
def calibrate(
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
    from mergekit_darts.integrations.post_merge import run_surgery

    run_surgery(
        out_path,
        surgery_yml,
        overwrite=overwrite,
        progress=not quiet,
        write_card=write_model_card,
        store=CaptureStore(cache_dir) if cache_dir else None,
    )


@main.command("export")
@click.argument("out_path", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path())
@click.option("--task", help="The surgery task to export (see OUT_PATH/surgery/manifest.json).")
@click.option("--all", "all_tasks", is_flag=True, help="Export every task, as DEST/<task>/.")
@click.option(
    "--link",
    type=click.Choice(LINKS),
    default="symlink",
    show_default=True,
    help="How DEST gets the merged weights; a Hub upload needs real files (copy or hardlink).",
)
def export_command(out_path: str, dest: str, task: str | None, all_tasks: bool, link: str) -> None:
    """Write DEST, a Hugging Face folder of the merge OUT_PATH with one surgery task built in.

    It loads with AutoModelForCausalLM.from_pretrained(DEST, trust_remote_code=True) where
    mergekit-darts is not installed, and serves with vLLM through the mergekit-darts plugin.
    """
    from mergekit_darts.deploy.export import export

    for folder in export(out_path, dest, task, all_tasks=all_tasks, link=link):
        click.echo(f"exported {folder}")


main.add_command(report_command)
main.add_command(sweep_command)
main.add_command(stats_command)
