"""The layering the folder names promise (README, layout): the correction, the surgery/ format,
the config and the calibration import with lm-eval, plotting, statistics and click unavailable,
and never reach into the layers built on them (present/, hosts/, ...).

Each check runs in a fresh interpreter whose ``sys.modules`` maps the unavailable packages to
None, so any import of them, direct or through another module, fails there."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

# what a surgery folder is read and computed without: evaluation and plotting, and the CLI's click
REPORTING = ("lm_eval", "lm_eval_darts", "matplotlib", "scipy")
UNAVAILABLE = (*REPORTING, "click")
LATER_LAYERS = ("calibrate", "present", "hosts", "analysis", "cli")

SCRIPT = """
import importlib, json, pkgutil, sys
for name in {unavailable!r}:
    sys.modules[name] = None
package = importlib.import_module({package!r})
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.slow  # starts a process per layer (about 10 s each)
@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("mergekit_darts.correction", ("task_map", "folder", "apply", "config", *LATER_LAYERS)),
        ("mergekit_darts.folder", ("apply", "config", *LATER_LAYERS)),
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
# correction/darts_correction.py and correction/modeling_darts.py are shipped inside exports and
# import nothing from this package, so they sit with the foundations; the rest of correction/
# builds on them, folder/ (the surgery/ format) on the correction, and so on down to the CLI.
LAYERS = [
    (
        "correction.darts_correction",
        "correction.modeling_darts",
        "errors",
        "envflags",
        "messages",
        "overlap",
    ),
    ("correction",),  # the kinds' sizes, training modules, losses, metrics, the LM head's path
    ("task_map",),
    ("folder",),  # manifest, artifacts, diagnostics, identity, fs
    ("apply",),
    ("config",),
    ("calibrate",),
    ("present",),  # the card, the summary, the report and its plots
    ("hosts",),  # mergekit, the post-merge step, lm-eval as a metric, the export, vLLM
    ("analysis",),
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
    upward = []
    for module, path in _modules("mergekit_darts").items():
        own = _layer(module)
        assert own is not None or module == "mergekit_darts", f"{module} is in no layer"
        upward += [
            f"{module} imports {name}"
            for name in _imported_names(module, path)
            if name.startswith("mergekit_darts") and own is not None and (_layer(name) or 0) > own
        ]
    assert not upward, upward


# Who may import hosts/deploy/ (the export): the CLI, which runs it. The vLLM plugin serves
# exported folders through the format the shipped correction/modeling_darts.py defines, so no
# other layer depends on how an export is written.
DEPLOY = "mergekit_darts.hosts.deploy"
DEPLOY_USERS = (DEPLOY, "mergekit_darts.cli")


def test_only_the_cli_imports_deploy():
    """Lazy imports inside functions count too."""
    found = [
        f"{module} imports {name}"
        for package in ("mergekit_darts", "lm_eval_darts")
        for module, path in _modules(package).items()
        if not module.startswith(DEPLOY_USERS)
        for name in _imported_names(module, path)
        if name.startswith(DEPLOY)
    ]
    assert not found, found


def test_the_correction_imports_only_itself_and_the_error_root():
    """correction/ is what every other folder builds on and what an export ships: of this package
    it reaches only its own modules and ``errors`` (which imports nothing)."""
    allowed = ("mergekit_darts.correction", "mergekit_darts.errors")
    found = [
        f"{module} imports {name}"
        for module, path in _modules("mergekit_darts").items()
        if module.startswith("mergekit_darts.correction")
        for name in _imported_names(module, path)
        if name.split(".")[0] == "mergekit_darts" and not name.startswith(allowed)
    ]
    assert not found, found


@pytest.mark.parametrize("folder", ["correction", "folder"])
def test_the_correction_and_the_format_reach_no_host_and_no_report(folder: str) -> None:
    """Nothing in correction/ or folder/ imports hosts/, present/, lm-eval, lm_eval_darts,
    matplotlib or scipy, lazily or not: a surgery folder is read and its correction computed
    with none of them."""
    prefix = f"mergekit_darts.{folder}"
    ours = ("mergekit_darts.hosts", "mergekit_darts.present")
    found = [
        f"{module} imports {name}"
        for module, path in _modules("mergekit_darts").items()
        if module == prefix or module.startswith(prefix + ".")
        for name in _imported_names(module, path)
        if name.startswith(ours) or name.split(".")[0] in REPORTING
    ]
    assert not found, found


def _reaches(package: str, targets: tuple[str, ...]) -> list[str]:
    """Every import in `package` (lazy ones included) of a top-level package in `targets`."""
    return [
        f"{module}: {name}"
        for module, path in _modules(package).items()
        for name in _imported_names(module, path)
        if name.split(".")[0] in targets
    ]


def test_lm_eval_darts_builds_on_the_core_never_the_reverse():
    reverse = _reaches("mergekit_darts", ("lm_eval_darts",))
    assert not reverse, reverse


@pytest.mark.parametrize("package", ["mergekit_darts", "lm_eval_darts"])
def test_the_product_never_imports_the_demo_or_the_benchmarks(package: str) -> None:
    """The wheel ships these two packages alone: an import of demo/ or benchmarks/ would fail
    in every installed copy."""
    found = _reaches(package, ("demo", "benchmarks", "tests"))
    assert not found, found


def _modules(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of a top-level package of this repository."""
    root = Path(__file__).resolve().parents[1]
    return {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted((root / package).rglob("*.py"))
    }


def _imported_names(module: str, path: Path) -> list[str]:
    """What ``module`` imports, as absolute dotted names (``from a import b`` gives ``a`` and
    ``a.b``): at the top, inside functions and under ``TYPE_CHECKING`` alike."""
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            names += [target, *(f"{target}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def _imports(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (a cycle through a lazy or
    ``TYPE_CHECKING`` import is still a cycle)."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        found = set()
        for name in _imported_names(module, path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
        graph[module] = found
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", ["mergekit_darts", "lm_eval_darts", "benchmarks", "demo"])
def test_no_import_cycles(package: str) -> None:
    """No two modules import each other, directly or through others: each module can be read,
    tested and imported knowing only what it imports."""
    assert _cycles(_imports(package)) == []


MAX_FUNCTION_LINES = 80


def test_no_function_in_the_packages_is_over_80_lines() -> None:
    """A function that long does several things: split it where its steps are."""
    root = Path(__file__).resolve().parents[1]
    long = []
    for package in ("mergekit_darts", "lm_eval_darts"):
        for file in sorted((root / package).rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{file.relative_to(root)}:{node.lineno} {node.name} ({lines})")
    assert not long, long
