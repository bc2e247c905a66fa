"""Boolean environment variables (``DARTS_NO_HOOK``, ``DARTS_OVERWRITE_SURGERY``), read one way.

``DARTS_OVERWRITE_SURGERY=false`` must never replace a folder and ``DARTS_NO_HOOK=0`` must never
switch the hook off, so every flag goes through :func:`env_flag`: 1/true/yes/on and
0/false/no/off (any case), empty or unset means the default, anything else is refused. The parser
itself is the startup hook's (``_darts_startup.flag``, installed beside the package), which reads
``DARTS_NO_HOOK`` on every Python start without importing this package.
"""

from __future__ import annotations

from collections.abc import Mapping

from _darts_startup import flag  # the one parser, shared with the startup hook

from mergekit_darts.errors import EnvFlagError

__all__ = ["NO_HOOK", "OVERWRITE_SURGERY", "EnvFlagError", "env_flag"]

NO_HOOK = "DARTS_NO_HOOK"  # switches the .pth startup hook off
OVERWRITE_SURGERY = "DARTS_OVERWRITE_SURGERY"  # lets the stock mergekit-yaml replace surgery/


def env_flag(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """The boolean value of environment variable ``name``; raises :class:`EnvFlagError` if unclear."""
    try:
        return flag(name, default, environ)
    except ValueError as err:
        raise EnvFlagError(str(err)) from None
