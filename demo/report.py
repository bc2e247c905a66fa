"""The demo's table and results.json: scores, paired differences against no surgery, regime.

Every surgery row is compared with its merge's no-surgery row on the same items: per-item
differences, mean over domains, 95 % paired-bootstrap interval with a fixed seed, so a reader
can tell a correction that helps from noise (DESIGN "Demo results"). With several surgery seeds
the table shows each row's mean over seeds and an interval that resamples seeds and items, and
calls a row better or worse only when that interval and every seed agree.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from demo.domains import DOMAIN_NAMES
from demo.evaluation import Evaluation
from demo.regime import gains_kept
from mergekit_darts.analysis.stats import paired_bootstrap, seeded_bootstrap

INDIVIDUAL = "Individual models"
BOOTSTRAP_SEED = 0
BOOTSTRAP_SAMPLES = 10_000


@dataclass
class Row:
    """One line of the table; `kind` is base | expert | none | surgery."""

    group: str
    label: str
    kind: str
    evaluation: Evaluation
    domain: str | None = None  # the expert's own domain
    rho: dict[str, float] = field(default_factory=dict)
    router: dict[str, float] | None = None  # routed rows: the router's held-out accuracy
    delta_vs_none: dict[str, Any] | None = None
    # surgery rows run with several surgery seeds: each seed's evaluation (the first is
    # `evaluation`), and the difference from no surgery over seeds and items
    seeds: dict[int, Evaluation] = field(default_factory=dict)
    delta_over_seeds: dict[str, Any] | None = None

    @property
    def scores(self) -> dict[str, float]:
        """The first surgery seed's scores (the only run when there is one seed)."""
        return self.evaluation.scores

    @property
    def shown(self) -> dict[str, float]:
        """What the table shows: the mean over surgery seeds, or the one run's scores."""
        if len(self.seeds) < 2:
            return self.scores
        runs = self.seeds.values()
        return {d: statistics.fmean(e.scores[d] for e in runs) for d in self.scores}

    @property
    def average(self) -> float:
        return sum(self.shown.values()) / len(self.shown)

    def record(self) -> dict[str, Any]:
        """The row as results.json holds it (per-item correctness stays in the eval cache)."""
        out: dict[str, Any] = {"group": self.group, "label": self.label, "kind": self.kind}
        if self.domain is not None:
            out["domain"] = self.domain
        out["scores"] = self.scores
        out["n_items"] = self.evaluation.n_items
        if self.rho:
            out["rho_l1"] = self.rho
        if self.router is not None:
            out["router_held_out"] = self.router
        if self.delta_vs_none is not None:
            out["delta_vs_none"] = self.delta_vs_none
        if len(self.seeds) > 1:
            out["surgery_seeds"] = list(self.seeds)
            out["scores_by_seed"] = {str(s): e.scores for s, e in self.seeds.items()}
            out["scores_mean_over_seeds"] = self.shown
        if self.delta_over_seeds is not None:
            out["delta_vs_none_over_seeds"] = self.delta_over_seeds
        return out


def add_deltas(rows: Sequence[Row]) -> None:
    """Fill `delta_vs_none` of each surgery row against its group's no-surgery row, in points
    (the first seed, items resampled), and `delta_over_seeds` when it ran with several seeds."""
    none = {row.group: row.evaluation for row in rows if row.kind == "none"}
    for row in rows:
        if row.kind != "surgery":
            continue
        ref = none[row.group]
        ci = paired_bootstrap(
            item_differences(row.evaluation, ref), BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED
        )
        row.delta_vs_none = {"mean": ci.mean, "ci95": [ci.low, ci.high]}
        if len(row.seeds) < 2:
            continue
        by_seed = {s: item_differences(e, ref) for s, e in row.seeds.items()}
        two = seeded_bootstrap(by_seed, BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED)
        spread = list(two.per_seed.values())
        row.delta_over_seeds = {
            "mean": two.mean,
            "ci95": [two.low, two.high],
            "by_seed": {str(s): v for s, v in two.per_seed.items()},
            "seed_sd": statistics.stdev(spread),
            "seed_range": [min(spread), max(spread)],
            "direction": two.direction,
        }


def item_differences(evaluation: Evaluation, ref: Evaluation) -> dict[str, list[float]]:
    """Per-item exact-match differences (points) of `evaluation` against `ref`, per domain."""
    diffs = {}
    for d in DOMAIN_NAMES:
        a, b = evaluation.items[d], ref.items[d]
        if len(a) != len(b):
            raise ValueError(f"{d} has {len(a)} items here and {len(b)} in the reference")
        diffs[d] = [100.0 * (x - y) for x, y in zip(a, b, strict=True)]
    return diffs


def significant(delta: dict[str, Any]) -> bool:
    """The 95 % interval excludes zero (and, over seeds, every seed's Δ has its sign)."""
    if "direction" in delta:
        return delta["direction"] != "no difference"
    low, high = delta["ci95"]
    return low > 0 or high < 0


def markdown_table(rows: Sequence[Row]) -> str:
    """Exact match % per domain, average, Δ vs no surgery [95 % CI], mean ρ_L1.

    With several surgery seeds: surgery rows show the mean over seeds, the interval resamples
    seeds and items, `*` marks a row every seed agrees with, and a column lists each seed's Δ.
    """
    seeds = max((len(row.seeds) for row in rows), default=0)
    delta_head = f"Δ vs none [95% CI, items × {seeds} seeds]" if seeds > 1 else "Δ vs none [95% CI]"
    head = ["Merge", "Surgery", *DOMAIN_NAMES, "Avg.", delta_head, "mean ρ_L1 / router"]
    if seeds > 1:
        head.insert(-1, "Δ per seed")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    group = None
    for row in rows:
        shown = row.group if row.group != group else ""
        group = row.group
        rho = f"{sum(row.rho.values()) / len(row.rho):.3f}" if row.rho else ""
        if row.router is not None:  # the router's held-out accuracy, tokens / prompts
            rho = (
                f"router {100 * row.router['token_accuracy']:.0f} % tok / "
                f"{100 * row.router['sequence_accuracy']:.0f} % prompts"
            )
        delta = ""
        shown_delta = row.delta_over_seeds or row.delta_vs_none
        if shown_delta is not None:
            low, high = shown_delta["ci95"]
            mark = " *" if significant(shown_delta) else ""
            mean = shown_delta["mean"]
            delta = f"{signed_points(mean)} [{signed_points(low)}, {signed_points(high)}]{mark}"
        cells = [
            shown,
            row.label,
            *(f"{row.shown[d]:.1f}" for d in DOMAIN_NAMES),
            f"{row.average:.1f}",
            delta,
            rho,
        ]
        if seeds > 1:
            per_seed = (row.delta_over_seeds or {}).get("by_seed", {})
            cells.insert(-1, " / ".join(signed_points(v) for v in per_seed.values()))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def shift_table(shifts: dict[str, dict[str, Any]]) -> str:
    """Generic text (none of the tasks): mean KL(plain || corrected) per token and top-1 changes,
    under the routed model and under each single DARTS module, per merge."""
    if not shifts:
        return ""
    names = [k for k in next(iter(shifts.values())) if k not in ("prompts", "tokens")]
    head = ["Merge (generic text)", *(f"{n}: KL / top-1 changed" for n in names)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for merge, shift in shifts.items():
        cells = [f"{shift[n]['kl']:.4f} / {shift[n]['top1_changed']:.1f} %" for n in names]
        lines.append("| " + " | ".join([merge, *cells]) + " |")
    return "\n".join(lines)


def signed_points(value: float) -> str:
    """Signed, one decimal, and never "-0.0"."""
    text = f"{value:+.1f}"
    return "+0.0" if text == "-0.0" else text


def regime(rows: Sequence[Row]) -> dict[str, Any]:
    """Share of each expert's gain over the base that each merge keeps without surgery."""
    base = next(r.scores for r in rows if r.kind == "base")
    experts = {r.domain: r.scores for r in rows if r.kind == "expert" and r.domain}
    out: dict[str, Any] = {
        "expert_own": {d: s[d] for d, s in experts.items()},
        "gain_over_base": {d: s[d] - base[d] for d, s in experts.items()},
        "gains_kept": {},
    }
    for row in rows:
        if row.kind == "none":
            out["gains_kept"][row.group] = gains_kept(base, experts, row.scores)
    return out


def summary(rows: Sequence[Row], regime_numbers: dict[str, Any]) -> str:
    """Plain-text lines: which surgery rows differ from no surgery, and the regime."""
    lines = []
    for row in rows:
        if row.delta_over_seeds is not None:
            direction = row.delta_over_seeds["direction"]
            verdict = {"better": "better than", "worse": "worse than"}.get(
                direction, "does not differ from"
            )
            seeds = ", ".join(row.delta_over_seeds["by_seed"])
            lines.append(
                f"{row.group} / {row.label}: {verdict} no surgery "
                f"(95% CI over items and surgery seeds {seeds}, and every seed's sign)"
            )
        elif row.delta_vs_none is not None:
            verdict = "differs from" if significant(row.delta_vs_none) else "does not differ from"
            lines.append(f"{row.group} / {row.label}: {verdict} no surgery (95% CI)")
    for merge, kept in regime_numbers["gains_kept"].items():
        shares = ", ".join(f"{d} {'n/a' if v is None else f'{v:.2f}'}" for d, v in kept.items())
        lines.append(f"{merge}, no surgery, share of each expert's gain kept: {shares}")
    return "\n".join(lines)
