"""Seeded tiny decoder family (base + code/math/instruct experts) for the CPU-scale demo."""

from mergekit_darts.demo.family import FamilyPaths, build_family

__all__ = ["FamilyPaths", "build_family"]
