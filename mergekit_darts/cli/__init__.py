"""``mergekit-darts``: the explicit commands, usable without the startup hook.

One thin file per command (``cli/<name>.py`` defines ``command``), like mergekit's ``scripts/``.
The group knows each command by a lazy ``"module:attribute"`` string, as lm-eval's registry does,
and imports it only when that command runs or its help is asked: ``mergekit-darts --help`` lists
the commands from the table below and imports no torch, transformers, matplotlib or scipy.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from typing import Any, NamedTuple

import click

from mergekit_darts.hosts.click_errors import one_line_errors


class Entry(NamedTuple):
    """A command the group imports only when it is used."""

    target: str  # "module:attribute" of the click command
    summary: str  # the first sentence of its help, for the command list


COMMANDS: dict[str, Entry] = {
    "merge": Entry(
        "mergekit_darts.cli.merge:command",
        "Merge CONFIG_FILE into OUT_PATH like mergekit-yaml, then run its `surgery:` block.",
    ),
    "calibrate": Entry(
        "mergekit_darts.cli.calibrate:command",
        "Add (or with --overwrite redo) surgery on the merged folder OUT_PATH.",
    ),
    "export": Entry(
        "mergekit_darts.cli.export:command",
        "Write DEST, a Hugging Face folder of the merge OUT_PATH with one surgery task built in "
        "(with --routed: every routed task's module behind the router; with --joint: the joint "
        "plain correction of every task).",
    ),
    "report": Entry(
        "mergekit_darts.cli.report:command",
        "Write a markdown + HTML report of MERGED/surgery with plots (paper Figure 1 and more).",
    ),
    "sweep": Entry(
        "mergekit_darts.cli.sweep:command",
        "Run an ablation grid of surgery settings on a merged model, or on a grid of merges.",
    ),
    "stats": Entry(
        "mergekit_darts.cli.stats:command",
        "Paired t / Wilcoxon tests of a vs b and the rho_L1-score correlation of a sweep.",
    ),
}


def load(entry: Entry) -> click.Command:
    """Import the command an entry names."""
    module, _, attribute = entry.target.partition(":")
    return getattr(import_module(module), attribute)


class LazyGroup(click.Group):
    """A group whose commands are imported on use; a ``DartsError`` is shown as one line."""

    def __init__(self, *args: Any, lazy_commands: Mapping[str, Entry], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.lazy_commands, *super().list_commands(ctx)})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = self.lazy_commands.get(cmd_name)
        return load(entry) if entry else super().get_command(ctx, cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """As click's, with its "Did you mean" drawn from the table too (not only added commands)."""
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as err:
            name = getattr(err, "command_name", None)  # set on click's NoSuchCommand (>= 8.4)
            if name is None:
                raise
            raise type(err)(name, possibilities=self.list_commands(ctx), ctx=ctx) from None

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from the table's summaries, shortened as click shortens a help."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        rows = []
        for name in names:
            entry = self.lazy_commands.get(name)
            command = click.Command(name, help=entry.summary) if entry else self.commands[name]
            if not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> Any:
        with one_line_errors():
            return super().invoke(ctx)


@click.group(cls=LazyGroup, lazy_commands=COMMANDS)
@click.version_option(package_name="mergekit-darts")
def main() -> None:
    """DARTS surgery for mergekit merges."""
