"""The surgery report: what each module removed, where in the sequence, and how training went.

A merged folder's ``surgery/`` holds the manifest and, per task, the per-token bias before and
after surgery (``diagnostics/<task>.safetensors``). This module turns them into a markdown and an
HTML page with the paper's Figure 1 (δ_t heat map, sample × position) before and after, mean δ_t
by position with the learned position bias ``||b_p||_1 / H`` on the same scale, the target's
entropy by position (the EWL1 weights), loss curves and ρ_L1 per task. ``--recompute`` rebuilds
the diagnostics from the calibration data and models (one model in memory at a time), e.g. for a
folder written without entropy, and checks that the prompts still hash to what the manifest says.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np

from mergekit_darts.correction.metrics import rho_from_deltas
from mergekit_darts.errors import ReportError, SurgeryFormatError
from mergekit_darts.folder.artifacts import load_surgery, read_manifest
from mergekit_darts.folder.diagnostics import diagnostics_path, read_diagnostics
from mergekit_darts.folder.fs import check_writable, write_text
from mergekit_darts.folder.manifest import MANIFEST, REPORT_DIR, SURGERY_YAML, Manifest, TaskEntry
from mergekit_darts.folder.manifest import surgery_dir as surgery_path
from mergekit_darts.present import plots
from mergekit_darts.present.document import Document

PAGES = ("report.md", "report.html", "rho_l1.png", "loss_curves.png")  # once per report
TASK_PLOTS = ("delta_heatmap", "delta_by_position", "entropy")  # <task>_<plot>.png per task


@dataclass
class Diagnostics:
    """Per-token arrays of one task, [N, T] each (numpy), and where they came from."""

    delta_before: np.ndarray
    delta_after: np.ndarray
    mask: np.ndarray  # real tokens
    loss_mask: np.ndarray  # the tokens the loss and rho_L1 counted
    entropy: np.ndarray | None = None
    notes: list[str] = field(default_factory=list)


# --- reading ---------------------------------------------------------------------------------


def load_diagnostics(surgery_dir: Path, entry: TaskEntry) -> Diagnostics | None:
    """The diagnostics the pipeline stored for one task, or None when there are none; a file
    that cannot be read is one line naming it (``--recompute`` does without it)."""
    path = diagnostics_path(surgery_dir, entry)
    if path is None:
        return None
    try:
        tensors = {k: plots.as_array(v) for k, v in read_diagnostics(path).items()}
    except SurgeryFormatError as err:
        raise ReportError(
            f"{err}: run `mergekit-darts report {surgery_dir.parent} --recompute`, which computes "
            "them anew"
        ) from None
    mask = tensors["mask"] > 0
    return Diagnostics(
        delta_before=tensors["delta_before"],
        delta_after=tensors["delta_after"],
        mask=mask,
        loss_mask=tensors["loss_mask"] > 0 if "loss_mask" in tensors else mask,
        entropy=tensors.get("entropy"),
    )


def position_bias_norm(surgery_dir: Path, task: str, entry: TaskEntry) -> np.ndarray | None:
    """``||b_p||_1 / H`` of a pos_corr module (other modules have no bias on δ's scale)."""
    if entry.module != "pos_corr":
        return None
    return plots.position_bias_norm(load_surgery(surgery_dir, task).position_bias)


def rho(diag: Diagnostics, mask: np.ndarray) -> float | None:
    """``1 - sum delta_after / sum delta_before`` over ``mask`` (paper eq. 7)."""
    return rho_from_deltas(diag.delta_before, diag.delta_after, mask)


def bias_growth(delta: np.ndarray, mask: np.ndarray) -> float | None:
    """Mean δ_t over the last third of positions / over the first third (paper: 2–3× for 7B)."""
    means, counts = plots.position_mean(delta, mask)
    seen = np.flatnonzero(counts > 0)
    if seen.size < 3:
        return None
    third = seen.size // 3
    early = np.average(means[seen[:third]], weights=counts[seen[:third]])
    late = np.average(means[seen[-third:]], weights=counts[seen[-third:]])
    return float(late / early) if early > 0 else None


# --- recomputing -----------------------------------------------------------------------------


def recompute(merged: Path, manifest: Manifest, progress: bool) -> dict[str, Diagnostics]:
    """Rebuild every task's diagnostics (with entropy) from ``surgery/surgery.yml``'s data.

    Captures come through the capture store (the block's ``cache_dir``, when it has one, makes
    this load no model); otherwise targets load one at a time (prompt completions regenerated
    greedily, as in calibration), then the merged model once. Relative paths resolve from the
    working directory, as when the surgery ran. Prompts whose sha256 differ from the manifest are
    reported in the notes.
    """
    from mergekit_darts.calibrate.data import load_prompts
    from mergekit_darts.calibrate.pipeline import PreparedSurgery, capture_tasks
    from mergekit_darts.calibrate.train import measure_bias
    from mergekit_darts.config import check_targets, parse_surgery, read_surgery_file, resolve_tasks

    surgery_dir = surgery_path(merged)
    block = read_surgery_file(surgery_dir / (manifest.config or SURGERY_YAML))
    config = parse_surgery(block)
    tasks = resolve_tasks(config)
    targets = check_targets(
        tasks,
        str(merged.resolve()),
        f"merged model {merged}",
        trust_remote_code=config.trust_remote_code,
        target_vocab=config.target_vocab,
    )
    prompts = {task.name: load_prompts(task) for task in tasks}
    prepared = PreparedSurgery(block, config, tasks, targets, prompts)
    captured = capture_tasks(merged, prepared, progress=progress)
    out = {}
    for task, cal in zip(tasks, captured.runs, strict=True):
        module = load_surgery(surgery_dir, task.name)
        before, after, _ = measure_bias(module, cal.merged, cal.target, cal.merged.mask)
        mask = cal.merged.mask.cpu()
        completion = cal.completion_mask
        loss_mask = mask & completion.cpu() if task.loss_positions == "completion" else mask
        notes = _hash_notes(prompts[task.name].sha256, manifest.tasks.get(task.name))
        out[task.name] = Diagnostics(
            delta_before=plots.as_array(before),
            delta_after=plots.as_array(after),
            mask=plots.as_array(mask) > 0,
            loss_mask=plots.as_array(loss_mask) > 0,
            entropy=plots.as_array(cal.target.entropy),
            notes=["Diagnostics recomputed from the calibration data and models.", *notes],
        )
    return out


def _hash_notes(sha256: Sequence[str], entry: TaskEntry | None) -> list[str]:
    stored = (entry.calibration.get("prompt_sha256") if entry else None) or []
    if list(sha256) == list(stored):
        return []
    differ = sum(a != b for a, b in zip(sha256, stored, strict=False)) + abs(
        len(sha256) - len(stored)
    )
    return [
        f"warning: {differ} calibration prompt(s) differ from those the module was trained on "
        "(prompt sha256 in the manifest); the recomputed bias is on different data"
    ]


# --- writing ---------------------------------------------------------------------------------


def _f(value: Any, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def write_report(
    merged: str | Path,
    *,
    output: str | Path | None = None,
    recompute_diagnostics: bool = False,
    progress: bool = True,
) -> Path:
    """Write ``report.md``, ``report.html`` and the PNGs; returns the markdown's path.

    The default place is ``<merged>/surgery/report/``, so a re-run surgery (which replaces
    ``surgery/``) never leaves a report describing modules that no longer exist. A place the
    report cannot go (a folder that cannot be written, a file in the way, a symbolic link that
    would lead the writes elsewhere) is refused in one line before anything is computed.
    """
    merged = Path(merged)
    surgery_dir = surgery_path(merged)
    manifest = read_manifest(surgery_dir)
    tasks = manifest.tasks
    out = Path(output) if output else surgery_dir / REPORT_DIR
    _check_out(out, [] if output else [surgery_dir, out], tasks)
    try:
        return _write(merged, manifest, out, recompute_diagnostics, progress)
    except OSError as err:
        where = f" ({err.filename})" if err.filename else ""
        raise ReportError(
            f"could not write the report to {out}: {err.strerror or err}{where}"
        ) from None


def _files(out: Path, tasks: Sequence[str]) -> list[Path]:
    """Every file a report of ``tasks`` may write into ``out``."""
    return [out / name for name in PAGES] + [
        _plot(out, task, plot) for task in tasks for plot in TASK_PLOTS
    ]


def _plot(out: Path, task: str, plot: str) -> Path:
    return out / f"{task}_{plot}.png"


def _check_out(out: Path, owned: list[Path], tasks: Sequence[str]) -> None:
    """``out`` exists (made if needed) and can be written, and no symbolic link stands where the
    report writes: ``owned`` (the folders of the default place inside the merged folder) and
    the report's own files, so a link in a downloaded model never redirects a write."""
    for path in [*owned, *_files(out, tasks)]:
        if path.is_symlink():
            raise ReportError(
                f"{path} is a symbolic link (to {os.readlink(path)}): the report writes only "
                "real files and folders; remove the link or choose --output"
            )
    try:
        out.mkdir(parents=True, exist_ok=True)
        check_writable(out)
    except OSError as err:
        where = f" ({err.filename})" if err.filename and err.filename != str(out) else ""
        raise ReportError(
            f"cannot write the report to {out}: {err.strerror or err}{where}; choose a "
            "writable folder with --output"
        ) from None


def _write(
    merged: Path, manifest: Manifest, out: Path, recompute_diagnostics: bool, progress: bool
) -> Path:
    surgery_dir = surgery_path(merged)
    tasks = manifest.tasks
    diagnostics = (
        recompute(merged, manifest, progress)
        if recompute_diagnostics
        else {t: load_diagnostics(surgery_dir, e) for t, e in tasks.items()}
    )
    doc = Document()
    doc.heading(1, f"DARTS surgery report: {merged.resolve().name}")
    doc.text(
        f"From `{surgery_dir / MANIFEST}` (mergekit-darts {version('mergekit-darts')}). "
        "δ_t = ‖ĥ_t − h*_t‖₁ / H per token; ρ_L1 = 1 − Σδ_after / Σδ_before over the tokens the "
        "loss counted (higher: more of the gap to the target removed)."
    )
    doc.table(
        ["task", "module", "loss", "rank", "steps", "lr", "seed", "positions", "prompts"]
        + ["tokens", "δ before", "δ after", "ρ_L1", "final loss"],
        [
            [
                t,
                e.module,
                e.loss,
                e.rank,
                e.steps,
                e.lr,
                e.seed,
                e.loss_positions,
                e.calibration["num_prompts"],
                e.metrics["tokens"],
                _f(e.metrics["delta_before"]),
                _f(e.metrics["delta_after"]),
                _f(e.metrics["rho_l1"], 3),
                _f(e.metrics["final_loss"]),
            ]
            for t, e in tasks.items()
        ],
    )
    rhos = {t: e.metrics["rho_l1"] for t, e in tasks.items()}
    doc.image(plots.plot_rho(rhos, out / PAGES[2]), "rho_L1 per task")
    curves, every = {}, {}
    for t, e in tasks.items():
        curves[t] = e.metrics.get("loss_curve") or []
        every[t] = e.metrics.get("loss_curve_every", 1)
    doc.image(plots.plot_loss_curves(curves, out / PAGES[3], every), "loss curves")
    for task, entry in tasks.items():
        _task_section(doc, out, surgery_dir, task, entry, diagnostics.get(task))
    markdown, html = (out / name for name in PAGES[:2])
    write_text(markdown, doc.markdown())
    write_text(html, doc.html(f"DARTS surgery report: {merged.name}"))
    return markdown


def _task_section(
    doc: Document,
    out: Path,
    surgery_dir: Path,
    task: str,
    entry: TaskEntry,
    diag: Diagnostics | None,
) -> None:
    cal = entry.calibration
    doc.heading(2, f"Task `{task}`")
    completion = cal.get("continuation_tokens") or 0
    doc.text(
        f"Target `{entry.target}`, serves lm-eval task(s) {', '.join(entry.eval_tasks)}. "
        f"Calibration: {cal['num_prompts']} prompts from `{cal['source']}`"
        + (f" + the target's greedy completion (≤ {completion} tokens)" if completion else "")
        + f"; loss on {entry.loss_positions} positions."
    )
    if diag is None:
        doc.text(
            "No per-token diagnostics are stored for this task: run "
            "`mergekit-darts report <folder> --recompute` to compute them."
        )
        return
    for note in diag.notes:
        doc.text(note)
    doc.text(
        f"ρ_L1 on the tokens the loss counted: {_f(rho(diag, diag.loss_mask), 3)}; on every "
        f"calibration token: {_f(rho(diag, diag.mask), 3)}."
    )
    growth = bias_growth(diag.delta_before, diag.mask)
    if growth is not None:
        doc.text(
            f"Bias growth with position: mean δ_t before surgery over the last third of "
            f"positions is {growth:.2f}× that over the first third (paper, Llama-2-7B: 2–3×)."
        )
    doc.image(
        plots.plot_delta_heatmap(
            diag.delta_before, diag.delta_after, diag.mask, _plot(out, task, "delta_heatmap"), task
        ),
        f"{task}: delta heat map",
    )
    doc.image(
        plots.plot_delta_by_position(
            diag.delta_before,
            diag.delta_after,
            diag.mask,
            _plot(out, task, "delta_by_position"),
            bias_norm=position_bias_norm(surgery_dir, task, entry),
            title=f"{task}: representation bias by position",
        ),
        f"{task}: delta by position",
    )
    if diag.entropy is None:
        doc.text(
            f"The target's entropy was not stored (it is computed for the ewl1 loss; this module "
            f"used {entry.loss}): `--recompute` computes it."
        )
    else:
        doc.image(
            plots.plot_entropy_by_position(
                diag.entropy,
                diag.mask,
                _plot(out, task, "entropy"),
                f"{task}: target entropy by position",
            ),
            f"{task}: entropy by position",
        )
