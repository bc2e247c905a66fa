"""The diagnostics file: what calibration writes is what the report and the leakage check read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mergekit_darts.folder.diagnostics import diagnostics_bytes, diagnostics_path, read_token_ids
from mergekit_darts.folder.manifest import TaskEntry, diagnostics_file


def _entry(diagnostics: str | None) -> TaskEntry:
    return TaskEntry(module="pos_corr", rank=2, max_positions=4, diagnostics=diagnostics)


def test_written_file_reads_back_in_report_and_leakage(tmp_path: Path) -> None:
    from lm_eval_darts.leakage import calibration_sequences
    from mergekit_darts.present.report import load_diagnostics

    sequences = [[2, 5, 6, 7], [2, 9]]
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    loss_mask = torch.tensor([[False, True, True, True], [False, True, False, False]])
    before = torch.tensor([[0.5, 1.0, 2.0, 4.0], [0.25, 0.75, 0.0, 0.0]])
    after = before / 4
    data = diagnostics_bytes(sequences, mask, loss_mask, before, after)
    entry = _entry(diagnostics_file("math"))
    (tmp_path / "diagnostics").mkdir()
    (tmp_path / entry.diagnostics).write_bytes(data)

    read = load_diagnostics(tmp_path, entry)
    np.testing.assert_array_equal(read.delta_before, before.numpy())
    np.testing.assert_array_equal(read.delta_after, after.numpy())
    np.testing.assert_array_equal(read.mask, mask.numpy())
    np.testing.assert_array_equal(read.loss_mask, loss_mask.numpy())
    assert read.entropy is None
    path = diagnostics_path(tmp_path, entry)
    assert calibration_sequences(path, drop={2}) == [[5, 6, 7], [9]]
    ids, real = read_token_ids(path)
    assert ids.tolist() == [[2, 5, 6, 7], [2, 9, 0, 0]] and real.dtype == torch.bool


def test_no_file_named_or_present_reads_as_none(tmp_path: Path) -> None:
    assert diagnostics_path(tmp_path, None) is None
    assert diagnostics_path(tmp_path, _entry(None)) is None
    assert diagnostics_path(tmp_path, _entry(diagnostics_file("math"))) is None


def test_bytes_are_reproducible() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    zero = torch.zeros(1, 2)
    entropy = torch.tensor([[0.1, 0.2]])
    first = diagnostics_bytes([[1, 2]], mask, mask, zero, zero, entropy=entropy)
    assert first == diagnostics_bytes([[1, 2]], mask, mask, zero, zero, entropy=entropy)
