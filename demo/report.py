"""The demo's table and results.json: scores, paired differences against no surgery, regime.

Every surgery row is compared with its merge's no-surgery row on the same items: per-item
differences, mean over domains, 95 % paired-bootstrap interval with a fixed seed, so a reader
can tell a correction that helps from noise (DESIGN "Demo results"). With several surgery seeds
the table shows each row's mean over seeds and an interval that resamples seeds and items, and
calls a row better or worse only when that interval and every seed agree. The long scale adds a
second table: per-token accuracy, and each surgery row against its merge's Standard + L1 row
(same surgery seed, same items), on exact match and per-token accuracy alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from demo.configs import STANDARD_L1_ROW
from demo.domains import DOMAIN_NAMES
from demo.evaluation import Evaluation
from demo.regime import gains_kept
from mergekit_darts.analysis.stats import paired_bootstrap, seeded_bootstrap

INDIVIDUAL = "Individual models"
BOOTSTRAP_SEED = 0
BOOTSTRAP_SAMPLES = 10_000
EXACT_MATCH, TOKEN_ACCURACY = "exact_match", "token_accuracy"
METRIC_NAMES = {EXACT_MATCH: "exact match", TOKEN_ACCURACY: "per-token accuracy"}
NONE, STANDARD = "none", STANDARD_L1_ROW.label  # the rows a long-scale row is compared with


class Comparison(NamedTuple):
    """One of the long scale's differences: `metric` against the row `against`."""

    metric: str
    against: str
    key: str  # in results.json
    head: str  # the table's column


LONG_DELTAS = (
    Comparison(TOKEN_ACCURACY, NONE, "delta_token_accuracy_vs_none", "Δ tok vs none"),
    Comparison(EXACT_MATCH, STANDARD, "delta_vs_standard_l1", f"Δ vs {STANDARD}"),
    Comparison(
        TOKEN_ACCURACY, STANDARD, "delta_token_accuracy_vs_standard_l1", f"Δ tok vs {STANDARD}"
    ),
)


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
    joint_kept: list[str] | None = None  # the joint row: the kind its verdict kept, per seed
    delta_vs_none: dict[str, Any] | None = None
    # surgery rows run with several surgery seeds: each seed's evaluation (the first is
    # `evaluation`), and the difference from no surgery over seeds and items
    seeds: dict[int, Evaluation] = field(default_factory=dict)
    delta_over_seeds: dict[str, Any] | None = None
    # the long scale: each Comparison's key -> the difference (over seeds with several)
    long_deltas: dict[str, dict[str, Any]] = field(default_factory=dict)

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

    @property
    def tokens_shown(self) -> dict[str, float]:
        """Per-token accuracy (%) as `shown` shows exact match: the mean over surgery seeds."""
        runs = list(self.seeds.values()) if len(self.seeds) > 1 else [self.evaluation]
        return {d: statistics.fmean(e.token_scores[d] for e in runs) for d in DOMAIN_NAMES}

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
        if self.joint_kept is not None:
            out["joint_kept"] = self.joint_kept
        if self.delta_vs_none is not None:
            out["delta_vs_none"] = self.delta_vs_none
        if len(self.seeds) > 1:
            out["surgery_seeds"] = list(self.seeds)
            out["scores_by_seed"] = {str(s): e.scores for s, e in self.seeds.items()}
            out["scores_mean_over_seeds"] = self.shown
        if self.delta_over_seeds is not None:
            out["delta_vs_none_over_seeds"] = self.delta_over_seeds
        if self.evaluation.tokens:
            out["token_accuracy"] = self.evaluation.token_scores
            if len(self.seeds) > 1:
                out["token_accuracy_by_seed"] = {
                    str(s): e.token_scores for s, e in self.seeds.items()
                }
                out["token_accuracy_mean_over_seeds"] = self.tokens_shown
        out.update(self.long_deltas)
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
        row.delta_over_seeds = _over_seeds(
            {s: item_differences(e, ref) for s, e in row.seeds.items()}
        )


def add_long_deltas(rows: Sequence[Row]) -> None:
    """Fill `long_deltas` of each surgery row (the long scale): per-token accuracy against its
    merge's no-surgery row, and exact match and per-token accuracy against its Standard + L1 row
    (seed s against seed s). Over seeds and items when the row ran with several, as
    `delta_over_seeds`; else items of the one run, as `delta_vs_none`."""
    none = {row.group: row for row in rows if row.kind == NONE}
    standard = {row.group: row for row in rows if row.kind == "surgery" and row.label == STANDARD}
    for row in rows:
        if row.kind != "surgery":
            continue
        refs = {NONE: none[row.group], STANDARD: standard[row.group]}
        row.long_deltas = {
            c.key: _delta(row, refs[c.against], c.metric)
            for c in LONG_DELTAS
            if refs[c.against] is not row
        }


def _delta(row: Row, ref: Row, metric: str) -> dict[str, Any]:
    """`row` minus `ref` on `metric`, paired by item and by surgery seed (a reference without
    seeds, no surgery, pairs with every seed)."""
    if len(row.seeds) < 2:
        diffs = item_differences(row.evaluation, ref.evaluation, metric)
        ci = paired_bootstrap(diffs, BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED)
        return {"mean": ci.mean, "ci95": [ci.low, ci.high]}
    by_seed = {
        s: item_differences(e, ref.seeds[s] if ref.seeds else ref.evaluation, metric)
        for s, e in row.seeds.items()
    }
    return _over_seeds(by_seed)


def _over_seeds(by_seed: dict[int, dict[str, list[float]]]) -> dict[str, Any]:
    """The two-level interval of per-seed, per-item differences, and the seeds' spread."""
    two = seeded_bootstrap(by_seed, BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED)
    spread = list(two.per_seed.values())
    return {
        "mean": two.mean,
        "ci95": [two.low, two.high],
        "by_seed": {str(s): v for s, v in two.per_seed.items()},
        "seed_sd": statistics.stdev(spread),
        "seed_range": [min(spread), max(spread)],
        "direction": two.direction,
    }


def item_differences(
    evaluation: Evaluation, ref: Evaluation, metric: str = EXACT_MATCH
) -> dict[str, list[float]]:
    """Per-item differences (points) of `evaluation` against `ref` on the same items."""
    diffs = {}
    for d in DOMAIN_NAMES:
        a, b = _per_item(evaluation, metric)[d], _per_item(ref, metric)[d]
        if len(a) != len(b):
            raise ValueError(f"{d} has {len(a)} items here and {len(b)} in the reference")
        diffs[d] = [100.0 * (x - y) for x, y in zip(a, b, strict=True)]
    return diffs


def _per_item(evaluation: Evaluation, metric: str) -> dict[str, list[float]]:
    """Each item's exact match (0/1) or per-token accuracy (0-1), per domain."""
    return evaluation.items if metric == EXACT_MATCH else evaluation.tokens


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
    seeds = _seeds(rows)
    head = ["Merge", "Surgery", *DOMAIN_NAMES, "Avg.", _ci_head("Δ vs none", seeds)]
    head.append("mean ρ_L1 / router / joint kept")
    if seeds > 1:
        head.insert(-1, "Δ per seed")
    lines = _head(head)
    for row, shown in _grouped(rows):
        rho = f"{sum(row.rho.values()) / len(row.rho):.3f}" if row.rho else ""
        if row.router is not None:  # the router's held-out accuracy, tokens / prompts
            rho = (
                f"router {100 * row.router['token_accuracy']:.0f} % tok / "
                f"{100 * row.router['sequence_accuracy']:.0f} % prompts"
            )
        if row.joint_kept is not None:  # what the joint verdict kept, per surgery seed
            rho = "kept " + " / ".join(row.joint_kept)
        cells = [
            shown,
            row.label,
            *(f"{row.shown[d]:.1f}" for d in DOMAIN_NAMES),
            f"{row.average:.1f}",
            delta_cell(row.delta_over_seeds or row.delta_vs_none),
            rho,
        ]
        if seeds > 1:
            per_seed = (row.delta_over_seeds or {}).get("by_seed", {})
            cells.insert(-1, " / ".join(_points(v) for v in per_seed.values()))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def long_table(rows: Sequence[Row]) -> str:
    """The long scale's second table: per-token accuracy % per domain and average, and each
    surgery row's Δ [95 % CI] (`*` as in the first table) of per-token accuracy vs no surgery,
    and of exact match and per-token accuracy vs its merge's Standard + L1 row."""
    seeds = _seeds(rows)
    tokens = [f"{d} tok" for d in DOMAIN_NAMES]
    lines = _head(
        ["Merge", "Surgery", *tokens, "Avg. tok", *(_ci_head(c.head, seeds) for c in LONG_DELTAS)]
    )
    for row, shown in _grouped(rows):
        accuracy = row.tokens_shown
        cells = [
            shown,
            row.label,
            *(f"{accuracy[d]:.1f}" for d in DOMAIN_NAMES),
            f"{statistics.fmean(accuracy.values()):.1f}",
            *(delta_cell(row.long_deltas.get(c.key)) for c in LONG_DELTAS),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _seeds(rows: Sequence[Row]) -> int:
    return max((len(row.seeds) for row in rows), default=0)


def _ci_head(name: str, seeds: int) -> str:
    return f"{name} [95% CI, items × {seeds} seeds]" if seeds > 1 else f"{name} [95% CI]"


def _head(head: list[str]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]


def _grouped(rows: Sequence[Row]) -> Iterator[tuple[Row, str]]:
    """Each row with its group's name, shown on the group's first row only."""
    group = None
    for row in rows:
        yield row, row.group if row.group != group else ""
        group = row.group


def delta_cell(delta: dict[str, Any] | None) -> str:
    """`mean [low, high]`, with ` *` when `significant`; empty without a difference."""
    if delta is None:
        return ""
    low, high = delta["ci95"]
    mark = " *" if significant(delta) else ""
    return f"{_points(delta['mean'])} [{_points(low)}, {_points(high)}]{mark}"


def shift_table(shifts: dict[str, dict[str, Any]]) -> str:
    """Generic text (none of the tasks): mean KL(plain || corrected) per token and top-1 changes,
    under the routed model, each single DARTS module and the joint plain correction, per merge."""
    if not shifts:
        return ""
    names = [k for k in next(iter(shifts.values())) if k not in ("prompts", "tokens")]
    head = ["Merge (generic text)", *(f"{n}: KL / top-1 changed" for n in names)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for merge, shift in shifts.items():
        cells = [f"{shift[n]['kl']:.4f} / {shift[n]['top1_changed']:.1f} %" for n in names]
        lines.append("| " + " | ".join([merge, *cells]) + " |")
    return "\n".join(lines)


def _points(value: float) -> str:
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
    """Plain-text lines: which surgery rows differ from no surgery (on the long scale also from
    Standard + L1, on exact match and per-token accuracy), and the regime."""
    lines = []
    for row in rows:
        delta = row.delta_over_seeds or row.delta_vs_none
        if delta is not None:
            lines.append(f"{row.group} / {row.label}: {_verdict(delta, 'no surgery')}")
        for c in LONG_DELTAS:
            if c.key in row.long_deltas:
                against = "no surgery" if c.against == NONE else c.against
                what = f"{against} on {METRIC_NAMES[c.metric]}"
                lines.append(f"{row.group} / {row.label}: {_verdict(row.long_deltas[c.key], what)}")
    for merge, kept in regime_numbers["gains_kept"].items():
        shares = ", ".join(f"{d} {'n/a' if v is None else f'{v:.2f}'}" for d, v in kept.items())
        lines.append(f"{merge}, no surgery, share of each expert's gain kept: {shares}")
    return "\n".join(lines)


def _verdict(delta: dict[str, Any], against: str) -> str:
    """How a difference compares its row with `against`: over seeds, better or worse only when
    the interval and every seed's sign agree; with one run, whether the interval excludes 0."""
    if "direction" not in delta:
        verdict = "differs from" if significant(delta) else "does not differ from"
        return f"{verdict} {against} (95% CI)"
    verdict = {"better": "better than", "worse": "worse than"}.get(
        delta["direction"], "does not differ from"
    )
    seeds = ", ".join(delta["by_seed"])
    return (
        f"{verdict} {against} (95% CI over items and surgery seeds {seeds}, and every seed's sign)"
    )
