"""The main job: tiny family -> stock `mergekit-yaml` with surgery -> `hf-darts` evaluation -> table.

Every expensive step is cached under the output folder (family by recipe hash, merges and
evaluations by the hash of their YAML / arguments), so a second run only re-renders the table.
The merges and evaluations of each method (and of the individual models) first fill that cache
in parallel processes, one thread each; the table is then read from it, in order, here.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from demo.configs import (
    JOINT_LABEL,
    ROUTED_LABEL,
    WHOLE_ANSWER_SUFFIX,
    Variant,
    lm_eval_task,
    merge_config,
    surgery_task,
    variants,
    write_config,
)
from demo.domains import DOMAIN_NAMES
from demo.evaluation import DemoSettings, Evaluation, digest, evaluate
from demo.evidence import (
    NONE_LABEL,
    Point,
    collect,
    plain_evidence,
    plain_markdown,
    selection_outcomes,
)
from demo.evidence import markdown as evidence_markdown
from demo.family import SCALES as TINY_SCALES
from demo.family import build_family
from demo.family_io import FamilyPaths
from demo.generic import logit_shift, write_generic_prompts
from demo.pinning import PINS, apply_in_process, pinned_env
from demo.report import (
    BOOTSTRAP_SAMPLES,
    BOOTSTRAP_SEED,
    INDIVIDUAL,
    Row,
    add_deltas,
    add_long_deltas,
    long_table,
    markdown_table,
    regime,
    shift_table,
    summary,
)
from demo.verdict_cells import cells as verdict_cells
from demo.verdict_cells import markdown as verdict_markdown
from mergekit_darts.folder.artifacts import read_manifest
from mergekit_darts.folder.manifest import Manifest, surgery_dir
from mergekit_darts.task_map import JOINT

console = Console()
__all__ = ["DemoSettings", "run_demo"]


def done_stamp(path: Path) -> Path:
    """The file beside ``path`` holding the cache key it was made with."""
    return path.with_name(path.name + ".done")


def is_current(stamp: Path, key: str) -> bool:
    """Whether what ``stamp`` marks was made with ``key`` (else it is made again)."""
    return stamp.is_file() and stamp.read_text() == key


def run_mergekit_yaml(
    config_path: Path, out_dir: Path, seed: int, fresh: bool, family_key: str = ""
) -> Path:
    """Run the stock `mergekit-yaml` console script (our startup hook adds the surgery).

    Cached by the config, the seed and `family_key` (the family's stamp): a rebuilt family
    (another recipe or other pins, same paths) is merged again."""
    stamp = done_stamp(out_dir)
    key = digest([config_path.read_text(), seed, family_key])
    if not fresh and is_current(stamp, key) and out_dir.is_dir():
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
    # the same kernel set and thread count as this process, whatever the caller's environment
    subprocess.run(command, check=True, env=pinned_env(os.environ))
    stamp.write_text(key)
    return out_dir


def _build(settings: DemoSettings) -> FamilyPaths:
    """The tiny family (`full`/`tiny`) or a SmolLM2 family (`real`, `long`), cached under
    out/family."""
    if settings.scale in TINY_SCALES:
        return build_family(settings.out / "family", settings.seed, settings.scale)
    from demo.real_family import build_real_family  # the SmolLM2 conversion's imports

    return build_real_family(settings.out / "family", settings.seed, scale=settings.scale)


def individual_rows(settings: DemoSettings, family: FamilyPaths) -> list[Row]:
    """The paper's Table 2: base and each expert on every domain."""
    key = family.stamp.read_text()

    def score(path: Path):
        return evaluate(settings, family, "hf", f"pretrained={path},dtype=float32", key)

    rows = [Row(INDIVIDUAL, "Base", "base", score(family.base))]
    for domain, path in family.experts.items():
        rows.append(Row(INDIVIDUAL, f"Expert: {domain}", "expert", score(path), domain))
    return rows


def merged_rows(
    settings: DemoSettings, family: FamilyPaths, method: str
) -> tuple[list[Row], list[Point], dict[str, Any]]:
    """No surgery, each surgery variant, the routed DARTS modules and the joint plain correction,
    on one merge, each surgery row once per surgery seed; the logit shift on generic text; the
    held-out evidence (full). Both come from the first seed."""
    background, measured = write_generic_prompts(settings.out / "data", settings.seed)
    shown = variants(settings.full, settings.scale)
    runs = [
        _surgery_run(settings, family, method, shown, background, s)
        for s in range(settings.surgery_seeds)
    ]
    merged, manifest, key = runs[0]
    for other, other_manifest, _ in runs[1:]:
        if other_manifest.merged_identity != manifest.merged_identity:
            raise RuntimeError(f"{other} is not the same merge as {merged}: compare their configs")

    def per_seed(args: str) -> dict[int, Evaluation]:
        return {
            s: evaluate(settings, family, "hf-darts", f"pretrained={m},dtype=float32,{args}", k)
            for s, (m, _, k) in enumerate(runs)
        }

    none = evaluate(
        settings, family, "hf-darts", f"pretrained={merged},dtype=float32,surgery=none", key
    )
    rows = [Row(method, NONE_LABEL, "none", none)]
    for variant in shown:
        names = {d: surgery_task(d) + variant.suffix for d in DOMAIN_NAMES}
        mapping = ";".join(f"{lm_eval_task(d)}:{names[d]}" for d in DOMAIN_NAMES)
        evaluations = per_seed(f"surgery=auto,surgery_map={mapping}")
        rho = _mean(
            [{d: m.tasks[names[d]].metrics["rho_l1"] for d in DOMAIN_NAMES} for _, m, _ in runs]
        )
        rows.append(
            Row(method, variant.label, "surgery", evaluations[0], rho=rho, seeds=evaluations)
        )
    routed = per_seed("surgery=routed")
    held_out = ("token_accuracy", "sequence_accuracy")
    accuracy = _mean([{k: m.router.held_out[k] for k in held_out} for _, m, _ in runs])
    rows.append(Row(method, ROUTED_LABEL, "surgery", routed[0], router=accuracy, seeds=routed))
    if manifest.joint is not None:  # the block fits it over its `select` tasks
        joint = per_seed(f"surgery={JOINT}")
        kept = [m.joint.module for _, m, _ in runs if m.joint is not None]
        rows.append(Row(method, JOINT_LABEL, "surgery", joint[0], joint_kept=kept, seeds=joint))
    corrections = [surgery_task(d) for d in DOMAIN_NAMES]
    if manifest.joint is not None:
        corrections.append(JOINT)
    shift = logit_shift(merged, measured, corrections)
    if not settings.full:
        return rows, [], shift
    first = {row.label: row.scores for row in rows}
    return rows, collect(method, manifest, first), shift


def _surgery_run(
    settings: DemoSettings,
    family: FamilyPaths,
    method: str,
    shown: tuple[Variant, ...],
    background: Path,
    surgery_seed: int,
) -> tuple[Path, Manifest, str]:
    """One `mergekit-yaml` run of `method` whose block trains with `surgery_seed` (the merge
    itself keeps the family seed): its folder, manifest and cache key."""
    name = merge_name(method, surgery_seed)
    config = merge_config(
        method,
        family.base,
        family.experts,
        {d: family.calib_file(d) for d in DOMAIN_NAMES},
        steps=settings.steps,
        cache_dir=settings.out / "captures",
        rows=shown,
        background=background,
        surgery_seed=surgery_seed,
    )
    config_path = write_config(config, settings.out / "configs" / f"{name}.yml")
    merged = run_mergekit_yaml(
        config_path,
        settings.out / "merges" / name,
        settings.seed,
        settings.fresh,
        family.stamp.read_text(),
    )
    key = done_stamp(merged).read_text()
    return merged, read_manifest(surgery_dir(merged)), key


def _position_figures(settings: DemoSettings, family: FamilyPaths, method: str) -> list[Path]:
    """Figure 1 over prompt + answer for one merge (demo.position_study), cached by the merge."""
    from demo.position_study import SUFFIXES, position_figures

    merged = settings.out / "merges" / method
    paths = [settings.out / "figures" / f"{method}_position_bias.{x}" for x in SUFFIXES]
    stamp = done_stamp(paths[0])
    key = done_stamp(merged).read_text()
    if not settings.fresh and is_current(stamp, key):
        return paths
    paths = position_figures(settings.out, merged, family, cont_suffix=WHOLE_ANSWER_SUFFIX)
    stamp.write_text(key)
    return paths


def merge_name(method: str, surgery_seed: int) -> str:
    """The folder (under out/merges) and config name of one `mergekit-yaml` run."""
    return method if surgery_seed == 0 else f"{method}_seed{surgery_seed}"


def _verdict_cells(settings: DemoSettings, rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The default verdict per (merge, domain) cell, against its best fixed candidate."""
    manifests = {
        method: [
            read_manifest(surgery_dir(settings.out / "merges" / merge_name(method, s)))
            for s in range(settings.surgery_seeds)
        ]
        for method in settings.methods
    }
    shown = [v for v in variants(settings.full, settings.scale) if v.selects]
    return verdict_cells(rows, shown, manifests)


def _mean(values: list[dict[str, float]]) -> dict[str, float]:
    """Key-wise mean over surgery seeds."""
    return {k: sum(v[k] for v in values) / len(values) for k in values[0]}


def bias_figures(settings: DemoSettings, method: str) -> list[Path]:
    """Figure 1 of the paper for each domain's DARTS module: delta_t before/after surgery."""
    from mergekit_darts.present.plots import plot_delta_by_position, plot_delta_heatmap
    from mergekit_darts.present.report import load_diagnostics, position_bias_norm

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


def run_demo(settings: DemoSettings) -> dict[str, Any]:
    """Build, merge, calibrate, evaluate; print and save the table; return the results."""
    pins = apply_in_process()
    console.print(f"[bold]pinned for reproducibility:[/bold] {pins}")
    if not pins["pinned_before_torch"]:
        console.print("[yellow]torch started unpinned: numbers may differ from the README[/yellow]")
    if pins["mkl_branch"] not in (None, PINS["MKL_CBWR"]):
        console.print(
            f"[yellow]MKL runs its {pins['mkl_branch']} branch, not {PINS['MKL_CBWR']}: "
            "numbers may differ from the README[/yellow]"
        )
    start, start_cpu = time.perf_counter(), time.process_time()
    settings.out.mkdir(parents=True, exist_ok=True)
    console.rule(f"1/3 model family ({settings.scale})")
    family = _build(settings)
    fill_caches(settings, family)
    cached = replace(settings, fresh=False)  # what fill_caches computed stays
    console.rule("2/3 individual models")
    rows = individual_rows(cached, family)
    points: list[Point] = []
    shifts: dict[str, Any] = {}
    for i, method in enumerate(settings.methods, 1):
        console.rule(f"3/3 merge {i}/{len(settings.methods)}: {method} + surgery, evaluation")
        merged, evidence, shifts[method] = merged_rows(cached, family, method)
        rows += merged
        points += evidence
    add_deltas(rows)
    cells = _verdict_cells(settings, rows)
    tables = [markdown_table(rows)]
    figures = bias_figures(settings, settings.methods[0])
    if settings.long_answers:  # answers reach past what the calibration prompts cover
        add_long_deltas(rows)
        tables.append(long_table(rows))
        figures += [p for m in settings.methods for p in _position_figures(settings, family, m)]
    plain = plain_evidence(rows, variants(settings.full, settings.scale), cells)
    table = "\n\n".join([*tables, shift_table(shifts)])
    regime_numbers = regime(rows)
    results: dict[str, Any] = {
        "settings": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(settings).items()},
            "pins": pins,
            "versions": _versions(),
            "bootstrap": {
                "samples": BOOTSTRAP_SAMPLES,
                "seed": BOOTSTRAP_SEED,
                "level": 0.95,
                "over_seeds": "surgery seeds and items resampled (seeded_bootstrap)",
            },
        },
        "rows": [row.record() for row in rows],
        "regime": regime_numbers,
        "generic_text_shift": shifts,
        "figures": [str(p) for p in figures],
        "verdict_cells": cells,
        "plain": plain,
    }
    if settings.full:
        results.update(_held_out_study(settings, rows, points))
    results["seconds"] = round(time.perf_counter() - start, 1)
    # CPU time (this process and the mergekit-yaml runs): what the demo costs on a busy machine
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = time.process_time() - start_cpu + children.ru_utime + children.ru_stime
    results["cpu_seconds"] = round(cpu, 1)
    (settings.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (settings.out / "table.md").write_text(table + "\n")
    (settings.out / "verdict.md").write_text(
        verdict_markdown({f"{settings.scale}, seed {settings.seed}": cells}) + "\n"
    )
    (settings.out / "plain.md").write_text(plain_markdown(plain) + "\n")
    print(table)  # plain print: rich would wrap the table's long lines
    print(plain_markdown(plain))
    print(summary(rows, regime_numbers))
    console.print(
        f"[green]done in {results['seconds']:.0f} s ({results['cpu_seconds']:.0f} s CPU); "
        f"table.md, plain.md, results.json under "
        f"{settings.out}[/green]"
    )
    return results


def fill_caches(settings: DemoSettings, family: FamilyPaths) -> None:
    """Run every method's merges and evaluations, and the individual models' evaluations, in
    processes of their own, as many at once as there are CPUs: each process is single-threaded
    under the same pins, so it computes what this one would, and writes it to the cache."""
    write_generic_prompts(settings.out / "data", settings.seed)  # written once, read by all
    jobs = [*settings.methods, None]  # None: the individual models
    workers = min(len(jobs), os.cpu_count() or 1)
    console.rule(f"merges and evaluations: {len(jobs)} jobs, {workers} at a time")
    # spawn: a fresh interpreter that starts torch under this process's environment (the pins)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=apply_in_process) as pool:
        futures = [pool.submit(_fill, settings, family, job) for job in jobs]
        try:
            for future in futures:
                future.result()
        except BaseException:
            pool.shutdown(cancel_futures=True)  # the first failure ends the run: start no more
            raise


def _fill(settings: DemoSettings, family: FamilyPaths, method: str | None) -> None:
    if method is None:
        individual_rows(settings, family)
    else:
        merged_rows(settings, family, method)


def _held_out_study(
    settings: DemoSettings, rows: Sequence[Row], points: Sequence[Point]
) -> dict[str, Any]:
    """`--full`: which held-out metric predicts the score, and what `select` kept."""
    select_scores = {
        (row.group, "completions" if v.continuation_tokens else "prompts"): row.scores
        for row in rows
        for v in variants(True, settings.scale)
        if v.selects and row.label == v.label
    }
    outcomes = selection_outcomes(points, select_scores)
    evidence_md = evidence_markdown(points, outcomes)
    (settings.out / "selection.md").write_text(evidence_md + "\n")
    console.print(evidence_md)
    return {"held_out": [vars(p) for p in points], "selection": outcomes}


def _versions() -> dict[str, str]:
    """Versions of what decides the numbers."""
    from importlib.metadata import version

    names = ("torch", "transformers", "lm_eval", "mergekit", "numpy", "tokenizers")
    return {"python": sys.version.split()[0], **{n: version(n) for n in names}}
