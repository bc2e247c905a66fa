"""Show a :class:`~mergekit_darts.errors.DartsError` the way click shows its own: one line.

The library raises plain exceptions; the commands people type (``mergekit-darts``, the stock
``mergekit-yaml`` and ``mergekit-multi`` through the hook) run under click, which prints a
``ClickException`` as ``Error: <message>`` with exit code 1 and a traceback for anything else.
The raised error keeps its class too, so Python callers of a hooked ``run_merge`` can still
catch ``SurgeryConfigError``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import click

from mergekit_darts.errors import DartsError


@functools.cache
def _cli_class(error_class: type[DartsError]) -> type:
    return type(error_class.__name__, (click.ClickException, error_class), {})


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
