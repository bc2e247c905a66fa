"""``lm-eval-darts``: the stock ``lm_eval`` command with ``hf-darts`` registered.

The explicit fallback for when the startup hook is off (``DARTS_NO_HOOK=1``) or was not installed.
It parses nothing itself: flags, subcommands and help are lm-eval's own.
"""

from __future__ import annotations

from lm_eval_darts.hook import register


def main() -> None:
    register()
    from lm_eval.__main__ import cli_evaluate  # after registering; this is lm-eval's own entry

    cli_evaluate()


if __name__ == "__main__":
    main()
