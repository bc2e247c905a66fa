"""Packaging metadata that users meet before any code runs."""

from __future__ import annotations

import tomllib
from pathlib import Path

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
