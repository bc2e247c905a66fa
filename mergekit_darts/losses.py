"""Stable public path: ``mergekit_darts.losses`` is :mod:`mergekit_darts.core.losses`."""

from mergekit_darts.core.losses import *  # noqa: F403
