"""The report's figures, as functions of plain arrays so the demo driver and notebooks reuse them.

Each function draws one PNG with matplotlib's object API (``Figure`` + Agg canvas), which never
touches pyplot's global backend: it works headless and inside a caller's own pyplot session.
Arrays may be numpy arrays or torch tensors; ``mask`` [N, T] marks the positions that count
(1 = real token), and everything outside it is left blank rather than drawn as zero bias.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from mergekit_darts.folder.fs import atomic_file

DPI = 110


def as_array(x: Any) -> np.ndarray:
    """numpy float64 view of a numpy array, list or (any dtype, any device) torch tensor."""
    if hasattr(x, "detach"):
        x = x.detach().to("cpu").double().numpy()
    return np.asarray(x, dtype=np.float64)


def _masked(values: Any, mask: Any) -> np.ndarray:
    values, keep = as_array(values), as_array(mask) > 0
    if values.shape != keep.shape:
        raise ValueError(f"values {values.shape} and mask {keep.shape} differ in shape")
    return np.where(keep, values, np.nan)


def position_mean(values: Any, mask: Any) -> tuple[np.ndarray, np.ndarray]:
    """Mean over samples of ``values`` [N, T] at each position, and how many samples count there."""
    masked = _masked(values, mask)
    counts = np.sum(~np.isnan(masked), axis=0)
    sums = np.nansum(masked, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan), counts


def position_bias_norm(position_bias: Any) -> np.ndarray:
    """``||b_p||_1 / H`` per position: the pos_corr table on the same scale as delta_t."""
    return np.abs(as_array(position_bias)).mean(axis=-1)


def _save(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as a new file (``atomic_file``): a link at ``path`` is replaced, never
    followed, and a reader never sees half an image."""
    path = Path(path)
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=DPI, bbox_inches="tight")
    return path


def _width(mask: Any) -> int:
    """Positions up to the last one any sample counts (no all-blank right margin)."""
    cols = np.flatnonzero((as_array(mask) > 0).any(axis=0))
    return int(cols[-1]) + 1 if cols.size else 1


def plot_delta_heatmap(
    delta_before: Any, delta_after: Any, mask: Any, path: str | Path, title: str = ""
) -> Path:
    """Paper Figure 1, before and after surgery: delta_t per sample (row) and position (column).

    Both panels share one colour scale (0 to the 99th percentile of the bias before), so the
    reduction is visible as fading.
    """
    width = _width(mask)
    before = _masked(delta_before, mask)[:, :width]
    after = _masked(delta_after, mask)[:, :width]
    finite = before[~np.isnan(before)]
    vmax = float(np.percentile(finite, 99)) if finite.size else 1.0
    fig = Figure(figsize=(11, 0.5 + 0.12 * before.shape[0] + 1.5))
    axes = fig.subplots(1, 2, sharey=True)
    cmap = colormaps["magma"].with_extremes(bad="#dddddd")
    image = None
    for ax, data, name in zip(
        axes, (before, after), ("before surgery", "after surgery"), strict=True
    ):
        image = ax.imshow(
            data, aspect="auto", interpolation="nearest", vmin=0.0, vmax=vmax or 1.0, cmap=cmap
        )
        ax.set_title(f"{title}: δ_t {name}" if title else f"δ_t {name}")
        ax.set_xlabel("token position")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel("calibration sample")
    fig.colorbar(image, ax=list(axes), label="δ_t = ‖h − h*‖₁ / H")
    return _save(fig, path)


def plot_delta_by_position(
    delta_before: Any,
    delta_after: Any,
    mask: Any,
    path: str | Path,
    bias_norm: Any | None = None,
    title: str = "",
) -> Path:
    """Mean delta_t by position before/after, with ``||b_p||_1 / H`` of pos_corr when given.

    The grey bars (right axis) count the samples that reach each position: late positions are
    averages of few sequences.
    """
    width = _width(mask)
    mean_before, counts = position_mean(delta_before, mask)
    mean_after, _ = position_mean(delta_after, mask)
    x = np.arange(width)
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    twin = ax.twinx()
    twin.bar(x, counts[:width], color="#cccccc", alpha=0.4, width=1.0)
    twin.set_ylabel("samples at position")
    ax.set_zorder(twin.get_zorder() + 1)
    ax.patch.set_visible(False)
    ax.plot(x, mean_before[:width], label="mean δ_t before", color="tab:red")
    ax.plot(x, mean_after[:width], label="mean δ_t after", color="tab:blue")
    if bias_norm is not None:
        norm = as_array(bias_norm)[:width]
        ax.plot(np.arange(norm.size), norm, "--", label="‖b_p‖₁ / H (position bias)", color="k")
    ax.set_xlabel("token position")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("δ_t")
    ax.legend(loc="best")
    ax.set_title(title or "representation bias by position")
    return _save(fig, path)


def plot_entropy_by_position(entropy: Any, mask: Any, path: str | Path, title: str = "") -> Path:
    """Mean and inter-quartile band of the target's next-token entropy by position (EWL1 weights)."""
    width = _width(mask)
    masked = _masked(entropy, mask)[:, :width]
    mean, _ = position_mean(entropy, mask)
    x = np.arange(width)
    fig = Figure(figsize=(8, 3.5))
    ax = fig.subplots()
    with np.errstate(all="ignore"):
        ok = ~np.all(np.isnan(masked), axis=0)
        low = np.full(width, np.nan)
        high = np.full(width, np.nan)
        low[ok] = np.nanpercentile(masked[:, ok], 25, axis=0)
        high[ok] = np.nanpercentile(masked[:, ok], 75, axis=0)
    ax.fill_between(x, low, high, alpha=0.3, color="tab:green", label="25–75 %")
    ax.plot(x, mean[:width], color="tab:green", label="mean")
    ax.set_xlabel("token position")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("target entropy H_t (nats)")
    ax.legend(loc="upper right")
    ax.set_title(title or "target entropy by position")
    return _save(fig, path)


def plot_loss_curves(
    curves: Mapping[str, Sequence[float]],
    path: str | Path,
    every: Mapping[str, int] | None = None,
) -> Path:
    """Training loss per step, one line per task (log scale when every value is positive).

    ``every[task] = k`` says the curve keeps every k-th step (the manifest thins long curves).
    """
    fig = Figure(figsize=(8, 3.5))
    ax = fig.subplots()
    positive = True
    for task, curve in curves.items():
        values = as_array(curve)
        step = (every or {}).get(task, 1)
        positive &= bool(values.size) and bool((values > 0).all())
        ax.plot(1 + step * np.arange(values.size), values, label=task)
    if positive and curves:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend()
    ax.set_title("surgery training loss")
    return _save(fig, path)


def plot_rho(rhos: Mapping[str, float], path: str | Path) -> Path:
    """rho_L1 per task as bars labelled in percent (paper eq. 7; higher = more bias removed)."""
    fig = Figure(figsize=(1.5 + 1.1 * max(len(rhos), 1), 3.5))
    ax = fig.subplots()
    names, values = list(rhos), [100 * float(v) for v in rhos.values()]
    bars = ax.bar(names, values, color="tab:blue")
    ax.bar_label(bars, fmt="%.1f%%")
    ax.axhline(0, color="k", linewidth=0.8)
    ax.set_ylabel("ρ_L1 (%)")
    ax.set_title("bias removed on the calibration set")
    return _save(fig, path)


def plot_rho_vs_score(
    points: Mapping[str, Sequence[tuple[float, float]]], path: str | Path
) -> Path:
    """Paper Table 3 as a scatter: rho_L1 of each sweep cell against its task score."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for task, pairs in points.items():
        xy = as_array(pairs).reshape(-1, 2)
        ax.scatter(100 * xy[:, 0], xy[:, 1], label=task)
    ax.set_xlabel("ρ_L1 (%)")
    ax.set_ylabel("task score")
    ax.legend()
    ax.set_title("bias reduction vs. task score over sweep cells")
    return _save(fig, path)
