"""``mergekit-darts merge``: ``mergekit-yaml`` plus the surgery, with every stock mergekit flag.

mergekit's flags come from its own decorator (``mergekit.options.add_merge_options``), so they
stay exactly mergekit-yaml's; but ``mergekit.options`` imports torch at its top (seconds). The
command people type therefore declares only its own arguments, enough to answer ``--help``; any
other call is parsed again, in full, by the command built with mergekit's decorator.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from mergekit.options import MergeOptions

HELP = """Merge CONFIG_FILE into OUT_PATH like mergekit-yaml, then run its `surgery:` block."""
EPILOG = """Every mergekit-yaml option is accepted as well (--cuda, --lazy-unpickle,
--out-shard-size, --random-seed, -v, ...) and parsed by mergekit itself: see `mergekit-yaml
--help` for the list."""


def _merge(
    merge_options: MergeOptions, config_file: str, out_path: str, overwrite_surgery: bool
) -> None:
    """The merge itself: mergekit's ``run_merge`` (unwrapped) under ``merge_with_surgery``."""
    import inspect

    import yaml
    from mergekit import merge as mergekit_merge
    from mergekit.config import MergeConfiguration

    from mergekit_darts.hosts.mergekit.hook import merge_with_surgery

    merge_options.apply_global_options()
    with open(config_file, encoding="utf-8") as file:
        config_source = file.read()
    merge_config = MergeConfiguration.model_validate(yaml.safe_load(config_source))
    stock = inspect.unwrap(mergekit_merge.run_merge)  # the hook may have wrapped it already
    merge_with_surgery(
        stock, merge_config, out_path, merge_options, config_source, overwrite=overwrite_surgery
    )


class MergeCommand(click.Command):
    """Answers ``--help`` from its own parameters; any other call runs the full command."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        # --help is eager: it is shown (and exits) in this parse, before mergekit is imported.
        # Its usage errors are dropped: the full parse below reports the real ones.
        with contextlib.suppress(click.UsageError):
            super().make_context(info_name, list(args), parent=parent, **extra)
        return with_mergekit_options().make_context(info_name, args, parent=parent, **extra)


command = MergeCommand(
    "merge",
    params=[
        click.Argument(["config_file"], type=click.Path(exists=True, dir_okay=False)),
        click.Argument(["out_path"]),
        click.Option(
            ["--overwrite-surgery"],
            is_flag=True,
            help="Replace an existing OUT_PATH/surgery/ folder instead of refusing.",
        ),
    ],
    help=HELP,
    epilog=EPILOG,
    context_settings={"ignore_unknown_options": True},  # so `--cuda --help` still shows help
)


@functools.cache
def with_mergekit_options() -> click.Command:
    """``merge`` with mergekit's options added by mergekit's own decorator, as mergekit-yaml has."""
    from mergekit.options import PrettyPrintHelp, add_merge_options

    return click.command(command.name, cls=PrettyPrintHelp, params=list(command.params), help=HELP)(
        add_merge_options(_merge)
    )
