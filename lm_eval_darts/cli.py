"""``lm-eval-darts``: the stock ``lm_eval`` command with ``hf-darts`` registered.

The explicit fallback for when the startup hook is off (``DARTS_NO_HOOK=1``) or was not installed.
It parses nothing itself: flags, subcommands and help are lm-eval's own. Under either command a
``DartsError`` (``surgery=maths``, a surgery folder that cannot be used) ends the run with one
line, as every mergekit-darts command does, not a traceback: the startup hook wraps the stock
command's ``cli_evaluate`` with :func:`install`.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType

from lm_eval_darts.hook import register


def exit_in_one_line(cli: Callable[[], None]) -> Callable[[], None]:
    """``cli`` printing a ``DartsError`` as :func:`~mergekit_darts.errors.error_line` does and
    exiting with status 1."""
    if getattr(cli, "__darts_hook__", False):
        return cli

    @functools.wraps(cli)
    def run() -> None:
        from mergekit_darts.errors import DartsError, error_line

        try:
            cli()
        except DartsError as err:
            sys.exit(error_line(err))

    run.__darts_hook__ = True  # type: ignore[attr-defined]
    return run


def install(main_module: ModuleType) -> None:
    """Startup-hook entry, called with the freshly imported ``lm_eval.__main__``."""
    main_module.cli_evaluate = exit_in_one_line(main_module.cli_evaluate)


def main() -> None:
    register()
    from lm_eval.__main__ import cli_evaluate  # after registering; this is lm-eval's own entry

    exit_in_one_line(cli_evaluate)()


if __name__ == "__main__":
    main()
