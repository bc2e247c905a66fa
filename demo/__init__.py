"""Seeded tiny decoder family (base + code/math/instruct experts) for the CPU-scale demo.

Imports nothing heavy: `python -m demo` must set its reproducibility pins
(demo.pinning) before the first `import torch`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FamilyPaths", "build_family"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from demo import family

        return getattr(family, name)
    raise AttributeError(name)
