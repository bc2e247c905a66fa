"""Stable public path: ``mergekit_darts.metrics`` is :mod:`mergekit_darts.core.metrics`."""

from mergekit_darts.core.metrics import *  # noqa: F403
