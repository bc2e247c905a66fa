"""Benchmarks of mergekit-darts: calibration cost, inference overhead, startup cost, scaling.

``make bench`` (``python -m benchmarks``) measures everything on random Llamas built locally and
writes ``benchmarks/results/bench.{md,json}`` and ``scaling.png``. Each cost is reported as a
ratio against a baseline measured in the same run (bare forward passes, a bare Adam loop, the
stock ``hf`` lm-eval class, ``DARTS_NO_HOOK=1``), so the numbers mean the same on any machine.
"""
