"""Lazy startup hook installed by mergekit-darts through a ``.pth`` file.

In the versions pyproject.toml allows, mergekit has no plugin hooks and lm-eval reads no model
entry points, so the stock ``mergekit-yaml`` and ``lm_eval`` commands can only learn about DARTS if
something patches them as they are imported. This module adds one cheap meta-path finder: it ignores every import except the
modules it watches, and for those it runs the real loader and then calls our patch function.
Nothing heavy (torch, mergekit, lm_eval) is imported until the user imports those packages.
Set ``DARTS_NO_HOOK=1`` to turn it off.
"""

import os
import sys

# watched module -> (module with an ``install(module)`` function) run after it finishes importing
_PATCHES = {
    "mergekit.merge": "mergekit_darts.hosts.mergekit.hook",
    "mergekit.scripts.multimerge": "mergekit_darts.hosts.mergekit.multimerge",  # mergekit-multi
    "lm_eval.models": "lm_eval_darts.hook",
    "lm_eval.__main__": "lm_eval_darts.cli",  # the stock lm_eval: one-line DartsError
}


class _PatchingLoader:
    """Wraps the real loader so the patch runs right after the module body executes."""

    def __init__(self, loader, patch_module: str):
        self._loader = loader
        self._patch_module = patch_module

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        __import__(self._patch_module, fromlist=["install"]).install(module)

    def __getattr__(self, name):  # get_source, get_code, is_package, ... for tools that ask
        return getattr(self._loader, name)


class _DartsFinder:
    """A meta-path finder that only answers for the watched modules."""

    def find_spec(self, name, path=None, target=None):
        patch_module = _PATCHES.get(name)
        if patch_module is None:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, patch_module)
        return spec


TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def flag(name, default=False, environ=None):
    """The boolean value of environment variable ``name``: 1/true/yes/on, 0/false/no/off (any
    case), empty or unset = ``default``; anything else raises a one-line ``ValueError``.

    The one parser of every DARTS_* flag (``mergekit_darts.envflags`` wraps it). It lives here,
    with no import, because the startup must read ``DARTS_NO_HOOK`` without importing
    ``mergekit_darts`` (a process that switched the hook off should not find the package loaded).
    """
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if not value:
        return default
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ValueError(
        f"{name}={raw!r} is not a boolean; set it to one of {'/'.join(TRUE)} or "
        f"{'/'.join(FALSE)}, or unset it"
    )


def main() -> None:
    """What the ``.pth`` line runs: :func:`install` unless ``DARTS_NO_HOOK`` says not to.

    A value that is not a boolean cannot stop a Python start: it is reported in one line and the
    hook stays on, so the hooked ``mergekit-yaml`` then refuses it before merging.
    """
    try:
        if flag("DARTS_NO_HOOK"):
            return
    except ValueError as err:
        print(f"mergekit-darts: {err} (the startup hook stays on)", file=sys.stderr)
    install()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _DartsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DartsFinder())
