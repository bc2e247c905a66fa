"""The main job: tiny family -> stock `mergekit-yaml` with surgery -> `hf-darts` evaluation -> table.

Every expensive step is cached under the output folder (family by recipe hash, merges and
evaluations by the hash of their YAML / arguments), so a second run only re-renders the table.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from mergekit_darts.artifacts import read_manifest
from mergekit_darts.demo.configs import (
    METHODS,
    VARIANTS,
    lm_eval_task,
    merge_config,
    surgery_task,
    write_config,
)
from mergekit_darts.demo.domains import DOMAIN_NAMES
from mergekit_darts.demo.evidence import Point, collect, selection_outcomes
from mergekit_darts.demo.evidence import markdown as evidence_markdown
from mergekit_darts.demo.family import FamilyPaths, build_family
from mergekit_darts.manifest import surgery_dir

console = Console()


@dataclass(frozen=True)
class DemoSettings:
    out: Path = Path("runs/demo")
    scale: str = "full"
    seed: int = 0
    methods: tuple[str, ...] = tuple(METHODS)
    steps: int = 500
    limit: int | None = None  # evaluation items per task (None: all)
    batch_size: int = 32
    fresh: bool = False  # recompute merges and evaluations even when cached


@dataclass
class Row:
    """One line of the table: exact-match % per domain, plus rho_L1 when surgery was applied."""

    group: str
    label: str
    scores: dict[str, float]
    rho: dict[str, float] = field(default_factory=dict)

    @property
    def average(self) -> float:
        return sum(self.scores.values()) / len(self.scores)


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[
        :16
    ]


def merge_with_surgery(config_path: Path, out_dir: Path, seed: int, fresh: bool) -> Path:
    """Run the stock `mergekit-yaml` console script (our startup hook adds the surgery)."""
    stamp = out_dir.with_name(out_dir.name + ".done")
    key = _digest([config_path.read_text(), seed])
    if not fresh and stamp.is_file() and stamp.read_text() == key and out_dir.is_dir():
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)
    stamp.unlink(missing_ok=True)
    command = [
        str(Path(sys.executable).with_name("mergekit-yaml")),
        str(config_path),
        str(out_dir),
        "--random-seed",
        str(seed),
    ]
    console.print(f"[bold]$ {' '.join(command)}[/bold]")
    # tiny models: one thread is several times faster than two (same results)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(command, check=True, env=env)
    stamp.write_text(key)
    return out_dir


def evaluate(
    settings: DemoSettings,
    family: FamilyPaths,
    model: str,
    model_args: str,
    cache_key: Any,
) -> dict[str, float]:
    """Exact match (%) per domain through lm-eval (in-process: same code path as `lm_eval`)."""
    cache = (
        settings.out / "evals" / f"{_digest([model, model_args, cache_key, settings.limit])}.json"
    )
    if not settings.fresh and cache.is_file():
        return json.loads(cache.read_text())
    import lm_eval

    tasks = [lm_eval_task(d) for d in DOMAIN_NAMES]
    console.print(
        f"[dim]lm_eval --model {model} --model_args {model_args} --tasks {','.join(tasks)} "
        f"--include_path {family.tasks} --batch_size {settings.batch_size}[/dim]"
    )
    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=tasks,
        task_manager=_task_manager(str(family.tasks)),
        batch_size=settings.batch_size,
        device="cpu",
        limit=settings.limit,
        verbosity="ERROR",
    )["results"]
    scores = {d: 100 * results[lm_eval_task(d)]["exact_match,none"] for d in DOMAIN_NAMES}
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(scores))
    return scores


@functools.cache
def _task_manager(include_path: str):
    """One task index for all evaluations: building it scans every lm-eval task (seconds)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, verbosity="ERROR")


def individual_rows(settings: DemoSettings, family: FamilyPaths) -> list[Row]:
    """The paper's Table 2: base and each expert on every domain."""
    models = {"Base": family.base, **{f"Expert: {d}": p for d, p in family.experts.items()}}
    return [
        Row(
            "Individual models",
            name,
            evaluate(settings, family, "hf", f"pretrained={path},dtype=float32", _stamp(family)),
        )
        for name, path in models.items()
    ]


def _stamp(family: FamilyPaths) -> str:
    return (family.root / "family.json").read_text()


def merged_rows(
    settings: DemoSettings, family: FamilyPaths, method: str
) -> tuple[list[Row], list[Point]]:
    """No surgery, then each surgery variant, on one merge; with the held-out evidence."""
    calib = {d: family.calib_file(d) for d in DOMAIN_NAMES}
    config = merge_config(
        method,
        family.base,
        family.experts,
        calib,
        steps=settings.steps,
        cache_dir=settings.out / "captures",
    )
    config_path = write_config(config, settings.out / "configs" / f"{method}.yml")
    merged = merge_with_surgery(
        config_path, settings.out / "merges" / method, settings.seed, settings.fresh
    )
    key = (merged.with_name(merged.name + ".done")).read_text()
    manifest = read_manifest(surgery_dir(merged))
    base_args = f"pretrained={merged},dtype=float32"
    rows = [
        Row(
            method,
            "None (merged)",
            evaluate(settings, family, "hf-darts", base_args + ",surgery=none", key),
        )
    ]
    for variant in VARIANTS:
        names = {d: surgery_task(d) + variant.suffix for d in DOMAIN_NAMES}
        mapping = ";".join(f"{lm_eval_task(d)}:{names[d]}" for d in DOMAIN_NAMES)
        args = f"{base_args},surgery=auto,surgery_map={mapping}"
        scores = evaluate(settings, family, "hf-darts", args, key)
        rho = {d: manifest.tasks[names[d]].metrics["rho_l1"] for d in DOMAIN_NAMES}
        rows.append(Row(method, variant.label, scores, rho))
    return rows, collect(method, manifest, {row.label: row.scores for row in rows})


def bias_figures(settings: DemoSettings, method: str) -> list[Path]:
    """Figure 1 of the paper for each domain's DARTS module: delta_t before/after surgery."""
    from mergekit_darts.analysis.plots import plot_delta_by_position, plot_delta_heatmap
    from mergekit_darts.analysis.report import load_diagnostics, position_bias_norm

    surgery = surgery_dir(settings.out / "merges" / method)
    manifest = read_manifest(surgery)
    paths = []
    for domain in DOMAIN_NAMES:
        task = surgery_task(domain)
        entry = manifest.tasks[task]
        diag = load_diagnostics(surgery, entry)
        if diag is None:
            continue
        stem = settings.out / "figures" / f"{method}_{task}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        title = f"{method}, {domain}"
        paths.append(
            plot_delta_heatmap(
                diag.delta_before, diag.delta_after, diag.mask, f"{stem}_delta_heatmap.png", title
            )
        )
        bias = position_bias_norm(surgery, task, entry)
        paths.append(
            plot_delta_by_position(
                diag.delta_before,
                diag.delta_after,
                diag.mask,
                f"{stem}_delta_by_position.png",
                title=title,
                bias_norm=bias,
            )
        )
    return paths


def markdown_table(rows: Sequence[Row]) -> str:
    """Table 1 / Table 2 layout: exact match % per domain, average, and mean rho_L1."""
    head = ["Merge", "Surgery", *DOMAIN_NAMES, "Avg.", "mean ρ_L1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    group = None
    for row in rows:
        shown = row.group if row.group != group else ""
        group = row.group
        rho = f"{sum(row.rho.values()) / len(row.rho):.3f}" if row.rho else ""
        cells = [
            shown,
            row.label,
            *(f"{row.scores[d]:.1f}" for d in DOMAIN_NAMES),
            f"{row.average:.1f}",
            rho,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_demo(settings: DemoSettings) -> dict[str, Any]:
    """Build, merge, calibrate, evaluate; print and save the table; return the results."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # see merge_with_surgery
    start = time.perf_counter()
    settings.out.mkdir(parents=True, exist_ok=True)
    console.rule("1/3 tiny model family")
    family = build_family(settings.out / "family", settings.seed, settings.scale)
    console.rule("2/3 individual models")
    rows = individual_rows(settings, family)
    points: list[Point] = []
    for i, method in enumerate(settings.methods, 1):
        console.rule(f"3/3 merge {i}/{len(settings.methods)}: {method} + surgery, evaluation")
        merged, evidence = merged_rows(settings, family, method)
        rows += merged
        points += evidence
    figures = bias_figures(settings, settings.methods[0])
    table = markdown_table(rows)
    select_scores = {
        (row.group, "completions" if v.continuation_tokens else "prompts"): row.scores
        for row in rows
        for v in VARIANTS
        if v.selects and row.label == v.label
    }
    outcomes = selection_outcomes(points, select_scores)
    evidence_md = evidence_markdown(points, outcomes)
    seconds = time.perf_counter() - start
    results = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(settings).items()},
        "rows": [vars(r) for r in rows],
        "figures": [str(p) for p in figures],
        "held_out": [vars(p) for p in points],
        "selection": outcomes,
        "seconds": round(seconds, 1),
    }
    (settings.out / "results.json").write_text(json.dumps(results, indent=2))
    (settings.out / "table.md").write_text(table + "\n")
    (settings.out / "selection.md").write_text(evidence_md + "\n")
    console.print(table)
    console.print(evidence_md)
    console.print(
        f"[green]done in {seconds:.0f} s; table, results.json under {settings.out}[/green]"
    )
    return results
