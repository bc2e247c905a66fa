"""``mergekit-darts export``: a folder that plain transformers (and vLLM) load corrected."""

from __future__ import annotations

import click

from mergekit_darts.deploy import LINKS


@click.command("export")
@click.argument("out_path", type=click.Path(exists=True, file_okay=False))
@click.argument("dest", type=click.Path())
@click.option("--task", help="The surgery task to export (see OUT_PATH/surgery/manifest.json).")
@click.option("--all", "all_tasks", is_flag=True, help="Export every task, as DEST/<task>/.")
@click.option(
    "--routed",
    is_flag=True,
    help="Export every routed task's module and the router (surgery block with route:) into "
    "one folder: each token gets its domain's correction without naming the task.",
)
@click.option(
    "--link",
    type=click.Choice(LINKS),
    default="symlink",
    show_default=True,
    help="How DEST gets the merged weights; a Hub upload needs real files (copy or hardlink).",
)
def command(
    out_path: str, dest: str, task: str | None, all_tasks: bool, routed: bool, link: str
) -> None:
    """Write DEST, a Hugging Face folder of the merge OUT_PATH with one surgery task built in
    (with --routed: every routed task's module behind the router).

    It loads with AutoModelForCausalLM.from_pretrained(DEST, trust_remote_code=True) where
    mergekit-darts is not installed, and serves with vLLM through the mergekit-darts plugin.
    """
    from mergekit_darts.deploy.export import export

    for folder in export(out_path, dest, task, all_tasks=all_tasks, routed=routed, link=link):
        click.echo(f"exported {folder}")
