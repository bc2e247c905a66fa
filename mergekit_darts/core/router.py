"""Routing: one corrected model for every task, without the task id (DESIGN "Routing").

A gate reads each token's final hidden state and weighs the task corrections:
``g(h) = softmax(W h + b)`` over the router's tasks, plus a last "none" class (text that should get
no correction) when it was fitted with background data, and

    ``h_hat_t = h_t - sum_k g_k(h_t) * (c_k(h_t) + b_k[p_t])``

where ``c_k + b_k`` is task ``k``'s module correction (the "none" class adds nothing). Each token is
corrected from its own hidden state and position only, so the result is exact under batching,
padding, KV caches, chunked prefill and prefix caching, like a single module. The classes are
those of :mod:`mergekit_darts.core.correction` (shipped inside every export), under the names the
rest of the package uses.
"""

from __future__ import annotations

from mergekit_darts.core.correction import NONE_CLASS, Router
from mergekit_darts.core.correction import DartsRoutedSurgery as RoutedSurgery

__all__ = ["NONE_CLASS", "RoutedSurgery", "Router"]
