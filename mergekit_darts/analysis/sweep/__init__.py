"""Ablation sweeps: a grid of surgery settings on one merged model, each cell calibrated and scored.

The paper's ablations (Tables 5, 6, 9-14) vary one or two settings — module, loss, rank, steps,
learning rate, calibration size, seed — and score every variant on the same benchmarks. A sweep
does that from one YAML: each grid cell runs the real post-merge step (``run_surgery``) into its
own folder and is evaluated in-process with lm-eval through ``hf-darts``, with per-item scores
logged so that :mod:`mergekit_darts.analysis.stats` can pair them. Each finished cell is written
to disk at once and skipped on the next run, so a killed sweep loses only its unscored cells.

Calibrate once, train many: the cells share one capture store
(:class:`~mergekit_darts.calibrate.store.CaptureStore`), so each model is loaded once for capture
in the whole sweep (none with a warm ``cache_dir``), and one ``hf-darts`` model per merge is kept
loaded across cells with its modules swapped between them. With ``merges:`` (a merge grid, the paper's section 4.1 protocol) each merge YAML is merged
with mergekit first and the grid runs on every merge, the targets captured once for all of them.

Read in this order: ``spec`` (``sweep.yml``), ``cell`` (one cell: block, fingerprint, surgery,
lm-eval score, record), ``merges`` (the merge grid), ``run`` (orchestration), ``tables``
(results files). The names below are re-exported; to replace a step in a test, patch it where
it is called (``cell.score_surgery``, ``cell.cell_surgery``), not here.
"""

from mergekit_darts.analysis.sweep.cell import (
    BASELINE,
    MERGE,
    RESULT,
    EvalModel,
    cell_block,
    cell_id,
    cell_surgery,
    cells,
    fingerprint,
    load_cell,
    rho_of,
    score_surgery,
    scores_of,
)
from mergekit_darts.analysis.sweep.merges import Merge, locate_merges, make_merge
from mergekit_darts.analysis.sweep.run import (
    check_served,
    plan,
    run_merge_cells,
    run_spec_file,
    run_sweep,
)
from mergekit_darts.analysis.sweep.spec import (
    GRID_TYPES,
    Compare,
    EvalSpec,
    SweepSpec,
    base_block,
    cache_dir,
    load_spec,
    output_dir,
)
from mergekit_darts.analysis.sweep.tables import (
    config_rows,
    method_label,
    results_csv,
    results_markdown,
    varied_axes,
    write_results,
)

__all__ = [
    "BASELINE",
    "GRID_TYPES",
    "MERGE",
    "RESULT",
    "Compare",
    "EvalModel",
    "EvalSpec",
    "Merge",
    "SweepSpec",
    "cache_dir",
    "cell_surgery",
    "cell_block",
    "cell_id",
    "cells",
    "check_served",
    "config_rows",
    "score_surgery",
    "fingerprint",
    "load_cell",
    "load_spec",
    "locate_merges",
    "make_merge",
    "method_label",
    "output_dir",
    "plan",
    "results_csv",
    "results_markdown",
    "rho_of",
    "run_merge_cells",
    "run_spec_file",
    "run_sweep",
    "scores_of",
    "base_block",
    "varied_axes",
    "write_results",
]
