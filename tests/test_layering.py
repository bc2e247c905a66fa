"""The layering the folder names promise (README, layout): core and config import with lm-eval,
plotting, statistics and click unavailable, and never reach into the layers built on them.

Each check runs in a fresh interpreter whose ``sys.modules`` maps the unavailable packages to
None, so any import of them, direct or through another module, fails there."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

UNAVAILABLE = ("lm_eval", "lm_eval_darts", "matplotlib", "scipy", "click")
LATER_LAYERS = ("calibrate", "integrations", "analysis", "deploy.export", "vllm_plugin", "cli")

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
        ("mergekit_darts.calibrate", LATER_LAYERS[1:]),
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


# Top-down: each layer may import itself and the layers listed before it, nothing after.
# deploy/modeling_darts.py is shipped inside exports and imports nothing from this package, so it
# sits with the foundations.
LAYERS = [
    (
        "errors",
        "envflags",
        "fs",
        "messages",
        "manifest",
        "routing",
        "deploy.modeling_darts",
        "deploy",
    ),
    ("identity",),  # a model folder's content identity, on the shipped file's fingerprint
    ("core", "losses", "metrics"),
    ("config",),
    ("artifacts", "apply"),
    ("calibrate",),
    ("integrations",),
    ("deploy.export", "vllm_plugin"),
    ("analysis",),
    ("demo",),
    ("cli",),
]


def _layer(module: str) -> int | None:
    """The index in LAYERS of ``mergekit_darts.<...>`` (the longest matching name wins)."""
    rest = module.removeprefix("mergekit_darts").lstrip(".")
    matches = [
        (len(name), index)
        for index, names in enumerate(LAYERS)
        for name in names
        if rest == name or rest.startswith(name + ".")
    ]
    return max(matches)[1] if matches else None


def test_every_import_runs_one_way():
    """Lazy imports inside functions count too: they are dependencies all the same."""
    root = Path(__file__).resolve().parents[1]
    upward = []
    for path in sorted((root / "mergekit_darts").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        own = _layer(module)
        assert own is not None or module == "mergekit_darts", f"{module} is in no layer"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "mergekit_darts"
            ):
                names = [f"{node.module}.{alias.name}" for alias in node.names]
                targets = [node.module] if _layer(node.module) else names
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("mergekit_darts")]
            else:
                continue
            upward += [
                f"{module} imports {t}"
                for t in targets
                if own is not None and (_layer(t) or 0) > own
            ]
    assert not upward, upward


def test_lm_eval_darts_builds_on_the_core_never_the_reverse():
    root = Path(__file__).resolve().parents[1]
    reverse = []
    for path in (root / "mergekit_darts").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            reverse += [f"{path.name}: {n}" for n in names if n.split(".")[0] == "lm_eval_darts"]
    assert not reverse, reverse
