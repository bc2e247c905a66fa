"""Packaging metadata that users meet before any code runs."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_requires_python_admits_what_the_dependencies_admit():
    """transformers 5, accelerate, scipy and matplotlib need 3.11; nothing caps the top, so
    the current distributions' defaults (3.12, 3.13) install."""
    meta = tomllib.loads(PYPROJECT.read_text())
    allowed = SpecifierSet(meta["project"]["requires-python"])
    for version in ("3.11", "3.11.7", "3.12", "3.12.1", "3.13", "3.13.0"):
        assert version in allowed, version
    assert "3.10" not in allowed
    assert meta["tool"]["ruff"]["target-version"] == "py311"  # lint for the lowest


def _lowest_pins_module():
    """``.ci/lowest_pins.py``, which ``make test-lowest`` runs, loaded as a module."""
    path = PYPROJECT.parent / ".ci" / "lowest_pins.py"
    spec = importlib.util.spec_from_file_location("lowest_pins", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tested_dependencies_are_ranges_not_pins():
    """Another patch or minor release installs beside this package; the next major does not."""
    meta = tomllib.loads(PYPROJECT.read_text())
    declared = {
        Requirement(line).name: Requirement(line) for line in meta["project"]["dependencies"]
    }
    for name in ("torch", "transformers", "mergekit", "lm-eval"):
        operators = {spec.operator for spec in declared[name].specifier}
        assert operators == {">=", "<"}, (name, str(declared[name].specifier))


def test_lowest_pins_are_the_lower_bounds(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\ndependencies = ["lm-eval[hf]>=0.4.12,<0.5", "Mergekit >= 0.1.5, < 0.2",'
        ' "pins==1.2", "open<3", "twice>=1,>=2"]\n'
    )
    pins = _lowest_pins_module().lowest_pins
    assert pins(["mergekit", "lm_eval", "pins"], pyproject) == [
        "Mergekit==0.1.5",
        "lm-eval[hf]==0.4.12",
        "pins==1.2",
    ]
    for name, message in [("nope", "declares no dependency 'nope'"), ("open", "one lower bound")]:
        with pytest.raises(SystemExit, match=message):
            pins([name], pyproject)
    with pytest.raises(SystemExit, match="one lower bound"):
        pins(["twice"], pyproject)


def test_lowest_pins_of_this_pyproject_install_as_requirements():
    """What ``make test-lowest`` writes: one requirement a line, each an exact pin."""
    pins = _lowest_pins_module().lowest_pins(["mergekit", "lm-eval", "transformers"])
    assert [Requirement(pin).name for pin in pins] == ["mergekit", "lm-eval", "transformers"]
    assert all({s.operator for s in Requirement(pin).specifier} == {"=="} for pin in pins)
