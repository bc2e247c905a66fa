"""Print ``name==X``, one a line (a requirements file), for each dependency named on the command
line, X its lower bound in pyproject.toml (``>=X`` or ``==X``): ``make test-lowest`` installs the
lowest versions the project declares, and the bounds keep one owner. Standard library only: it
runs before any install.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*)")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lowest_pins(names: list[str], pyproject: Path = PYPROJECT) -> list[str]:
    """``name[extras]==lower bound`` for each of ``names``, in their order."""
    declared = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["dependencies"]
    by_name = {}
    for line in declared:
        name, extras, specifiers = REQUIREMENT.match(line).groups()
        by_name[_canonical(name)] = (name, extras or "", specifiers)
    pins = []
    for wanted in names:
        if _canonical(wanted) not in by_name:
            raise SystemExit(f"{pyproject.name} declares no dependency {wanted!r}")
        name, extras, specifiers = by_name[_canonical(wanted)]
        lows = [
            s.strip()[2:].strip() for s in specifiers.split(",") if s.strip()[:2] in (">=", "==")
        ]
        if len(lows) != 1:
            raise SystemExit(f"{name}{specifiers}: expected one lower bound (>=X or ==X)")
        pins.append(f"{name}{extras}=={lows[0]}")
    return pins


if __name__ == "__main__":
    print("\n".join(lowest_pins(sys.argv[1:])))
