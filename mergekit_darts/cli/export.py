"""``mergekit-darts export``: a folder that plain transformers (and vLLM) load corrected."""

from __future__ import annotations

import click

from mergekit_darts.hosts.deploy import LINKS


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
    "--joint",
    is_flag=True,
    help="Export the joint plain correction of every task (fitted for blocks of two or more "
    "tasks with plain candidates) as one plain folder: one model for every task, served by any "
    "engine without a task id.",
)
@click.option(
    "--link",
    type=click.Choice(LINKS),
    default="symlink",
    show_default=True,
    help="How DEST gets the merged weights; a Hub upload needs real files (copy or hardlink).",
)
def command(
    out_path: str,
    dest: str,
    task: str | None,
    all_tasks: bool,
    routed: bool,
    joint: bool,
    link: str,
) -> None:
    """Write DEST, a Hugging Face folder of the merge OUT_PATH with one surgery task built in
    (with --routed: every routed task's module behind the router; with --joint: the joint
    plain correction of every task).

    A plain correction (module head or norm, and --joint) is folded into the merge's own
    tensors: DEST is an ordinary checkpoint that any engine serves. Any other loads with
    AutoModelForCausalLM.from_pretrained(DEST, trust_remote_code=True) where mergekit-darts is
    not installed, and serves with vLLM through the mergekit-darts plugin.
    """
    from mergekit_darts.hosts.deploy.export import export

    flags = {"all_tasks": all_tasks, "routed": routed, "joint": joint}
    for folder in export(out_path, dest, task, **flags, link=link):
        click.echo(f"exported {folder}")
