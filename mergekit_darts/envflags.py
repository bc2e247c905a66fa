"""Boolean environment variables (``DARTS_NO_HOOK``, ``DARTS_OVERWRITE_SURGERY``), read one way.

``DARTS_OVERWRITE_SURGERY=false`` must never replace a folder and ``DARTS_NO_HOOK=0`` must never
switch the hook off, so every flag goes through :func:`env_flag`: 1/true/yes/on and
0/false/no/off (any case), empty or unset means the default, anything else is refused. The
``.pth`` startup hook imports this module on every Python start that sets ``DARTS_NO_HOOK``, so it
imports nothing but ``os`` and the (import-free) error root.
"""

from __future__ import annotations

import os

from mergekit_darts.errors import DartsError

TYPE_CHECKING = False  # not typing's: importing typing costs ~10 ms on every start
if TYPE_CHECKING:
    from collections.abc import Mapping

NO_HOOK = "DARTS_NO_HOOK"  # switches the .pth startup hook off
OVERWRITE_SURGERY = "DARTS_OVERWRITE_SURGERY"  # lets the stock mergekit-yaml replace surgery/

TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


class EnvFlagError(DartsError, ValueError):
    """A boolean environment variable holds something that is not a boolean."""


def env_flag(name: str, default: bool = False, environ: Mapping[str, str] | None = None) -> bool:
    """The boolean value of environment variable ``name``; raises :class:`EnvFlagError` if unclear."""
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise EnvFlagError(
        f"{name}={raw!r} is not a boolean; set it to one of {'/'.join(TRUE)} or "
        f"{'/'.join(FALSE)}, or unset it"
    )
