"""The layering the folder names promise (README, layout): core and config import with lm-eval,
plotting, statistics and click unavailable, and never reach into the layers built on them.

Each check runs in a fresh interpreter whose ``sys.modules`` maps the unavailable packages to
None, so any import of them, direct or through another module, fails there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

UNAVAILABLE = ("lm_eval", "lm_eval_darts", "matplotlib", "scipy", "click")
LATER_LAYERS = ("calibrate", "integrations", "analysis", "deploy", "cli")

SCRIPT = """
import importlib, json, pkgutil, sys
for name in {unavailable!r}:
    sys.modules[name] = None
package = importlib.import_module({package!r})
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("mergekit_darts.core", ("config", *LATER_LAYERS)),
        ("mergekit_darts.config", LATER_LAYERS),
    ],
)
def test_layer_imports_without_what_comes_after_it(package, forbidden):
    script = SCRIPT.format(unavailable=UNAVAILABLE, package=package)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    reached = [
        name
        for name in loaded
        if any(name.startswith(f"mergekit_darts.{layer}") for layer in forbidden)
    ]
    assert not reached, f"{package} imports {reached}"
