"""The post-merge step: calibrate a merged folder, then record the block and update the card.

This is what ``mergekit-yaml`` (through the hook), ``mergekit-darts merge`` / ``calibrate`` and
:func:`mergekit_darts.run_surgery` run after a merge: the calibration pipeline writes
``surgery/``; this module adds what people read beside it (the recipe's ``surgery:`` block, the
model card's section, the printed summary).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mergekit_darts.calibrate.pipeline import (
    PhaseHook,
    PreparedSurgery,
    calibrate,
    no_phase,
    prepare_surgery,
)
from mergekit_darts.calibrate.store import CaptureStore
from mergekit_darts.config import SurgeryConfig
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.folder.identity import check_one_merge
from mergekit_darts.hosts.lm_eval_dev import check_dev
from mergekit_darts.hosts.mergekit.record import record_block
from mergekit_darts.present.card import update_model_card
from mergekit_darts.present.summary import print_summary


def run_surgery(
    merged_path: str | Path,
    surgery_config: SurgeryConfig | Mapping[str, Any] | str | Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
    write_card: bool = True,
    store: CaptureStore | None = None,
    on_phase: PhaseHook = no_phase,
) -> dict[str, Any]:
    """Calibrate and save ``merged_path/surgery/``; returns the manifest as written (its JSON form).

    ``surgery_config`` is the block (a mapping or a ``SurgeryConfig``) or a YAML file holding a
    merge config with ``surgery:`` or just the block. An existing ``surgery/`` is replaced only
    with ``overwrite``. ``write_card`` appends the surgery section to ``README.md``. ``store``
    (default: a fresh one on the block's ``cache_dir``) lends captures made earlier.
    ``on_phase(name)`` wraps each phase ("target", "merged", "train") in the caller's context
    (benchmarks time them and track memory peaks with it).
    """
    merged = Path(merged_path)
    if not (merged / "config.json").is_file():
        raise SurgeryConfigError(
            f"{merged} is not a merged model folder (no config.json); run the merge first"
        )
    check_one_merge(merged)
    prepared = prepare_surgery(
        surgery_config,
        reference=str(merged.resolve()),
        reference_label=f"merged model {merged}",
        out_path=merged,
        overwrite=overwrite,
    )
    prepared = check_dev(prepared, str(merged.resolve()))
    return run_prepared(
        merged, prepared, progress=progress, write_card=write_card, store=store, on_phase=on_phase
    )


def run_prepared(
    merged_path: str | Path,
    prepared: PreparedSurgery,
    *,
    progress: bool = True,
    write_card: bool = True,
    store: CaptureStore | None = None,
    on_phase: PhaseHook = no_phase,
) -> dict[str, Any]:
    """The expensive part of :func:`run_surgery`, for a block ``prepare_surgery`` has checked."""
    merged = Path(merged_path)
    store = store if store is not None else CaptureStore(prepared.config.cache_dir)
    written = calibrate(merged, prepared, progress=progress, store=store, on_phase=on_phase)
    record_block(merged, prepared.block, card=write_card)
    if write_card:
        update_model_card(merged, written)
    if progress:
        print_summary(written)
        print(store.summary())
    return written.to_dict()
