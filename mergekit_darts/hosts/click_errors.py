"""Show a :class:`~mergekit_darts.errors.DartsError` under click: one line, exit status 1.

The library raises plain exceptions; the commands people type (``mergekit-darts``, the stock
``mergekit-yaml`` and ``mergekit-multi`` through the hook) run under click, which prints a
``ClickException`` with exit code 1 and a traceback for anything else. The re-raised error is a
``ClickException`` printed by :func:`~mergekit_darts.errors.error_line`, the line every command
prints, and keeps its class too, so Python callers of a hooked ``run_merge`` can still catch
``SurgeryConfigError``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import click

from mergekit_darts.errors import DartsError, error_line


def _show(self: click.ClickException, file: IO[Any] | None = None) -> None:
    click.echo(error_line(self), file=file, err=file is None)


@functools.cache
def _cli_class(error_class: type[DartsError]) -> type:
    return type(error_class.__name__, (click.ClickException, error_class), {"show": _show})


@contextmanager
def one_line_errors(prefix: str = "") -> Iterator[None]:
    """Re-raise a ``DartsError`` as click's one-line error, with ``prefix`` before its message."""
    try:
        yield
    except DartsError as err:
        if isinstance(err, click.ClickException):
            err.message = prefix + err.message
            raise
        raise _cli_class(type(err))(prefix + str(err)) from None
