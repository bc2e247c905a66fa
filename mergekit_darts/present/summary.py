"""The run in the terminal: one table per task, the held-out, selection, router and joint tables,
and what ``select`` kept, printed after calibration."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from mergekit_darts.calibrate.selection import candidate_label
from mergekit_darts.config.schema import LM_EVAL
from mergekit_darts.folder.manifest import JointEntry, Manifest, RouterEntry
from mergekit_darts.present.rows import (
    joint_results,
    loss_label,
    number,
    router_rows,
    verdict_line,
)


def print_summary(manifest: Manifest, console: Console | None = None) -> None:
    """One row per task: how much of the merged model's bias its module removed; with held-out
    prompts, agreement and KL on them before -> after; with ``select``, every candidate."""
    tasks = manifest.tasks
    with_completion = any("rho_l1_completion" in e.metrics for e in tasks.values())
    table = Table(title="DARTS surgery", title_justify="left", box=box.SIMPLE_HEAD)
    for column in ("task", "module", "loss", "positions", "tokens", "δ before", "δ after", "ρ_L1"):
        left = column in ("task", "module", "loss", "positions")
        table.add_column(column, justify="left" if left else "right")
    if with_completion:
        table.add_column("ρ_L1 completion", justify="right")
    for task, entry in tasks.items():
        metrics = entry.metrics
        row = [
            task,
            entry.module,
            loss_label(entry),
            entry.loss_positions,
            str(metrics["tokens"]),
            f"{metrics['delta_before']:.4f}",
            f"{metrics['delta_after']:.4f}",
            f"{metrics['rho_l1']:.3f}",
        ]
        if with_completion:
            row.append(number(metrics.get("rho_l1_completion")))
        table.add_row(*row)
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file or a pipe: no reason to squeeze into 80 columns
            console = Console(width=120)
    console.print(table)
    held_out = {task: e.held_out for task, e in tasks.items() if e.held_out is not None}
    if held_out:
        console.print(_held_out_table(held_out))
    selecting = {task: e.selection for task, e in tasks.items() if e.selection is not None}
    if selecting:
        console.print(_selection_table(selecting))
    for task, entry in tasks.items():
        if line := verdict_line(task, entry, card=False):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    if manifest.router is not None:
        console.print(_router_table(manifest.router))
    if manifest.joint is not None:
        console.print(_joint_table(manifest.joint))
        verdict = manifest.joint.selection.get("verdict", "")
        console.print(f"joint: {verdict}", markup=False, highlight=False, soft_wrap=True)


def _joint_table(joint: JointEntry) -> Table:
    metric = joint.selection.get("metric", "")
    table = Table(
        title=f"joint correction of every task ({joint.module} kept): held-out {metric} per task",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for column in ("candidate", "task", metric, "none", "better", "worse", "p better", "p worse"):
        table.add_column(column, justify="left" if column in ("candidate", "task") else "right")
    for label, task, r in joint_results(joint.selection):
        table.add_row(
            label,
            task,
            number(r["mean"], ".3g"),
            number(r["none"], ".3g"),
            str(r["better"]),
            str(r["worse"]),
            f"{r['p_better']:.3g}",
            f"{r['p_worse']:.3g}",
        )
    return table


def _router_table(router: RouterEntry) -> Table:
    table = Table(
        title="router: held-out prompts, how often the gate picks their own task (per token, "
        "per prompt)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for column in ("class", "prompts", "tokens", "token accuracy", "prompt accuracy"):
        table.add_column(column, justify="left" if column == "class" else "right")
    for row in router_rows(router):
        table.add_row(*row)
    return table


def _held_out_table(held_out: Mapping[str, Mapping[str, Any]]) -> Table:
    """Per task and position set: agreement and KL before→after, ρ_L1, on the held-out prompts."""
    table = Table(
        title="held-out prompts: merged → corrected (agreement with the target's top-1 token, "
        "KL(target ‖ merge))",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for column in ("task", "positions", "prompts", "tokens", "agreement", "KL", "ρ_L1"):
        table.add_column(column, justify="left" if column in ("task", "positions") else "right")
    for task, held in held_out.items():
        for positions in ("all", "completion"):
            if positions not in held:
                continue
            m = held[positions]
            table.add_row(
                task if positions == "all" else "",
                positions + ("" if held["saved_module"] else " (before refit)"),
                str(len(held["prompt_sha256"])),
                str(m["tokens"]),
                f"{number(m['agreement_before'])} → {number(m['agreement_after'])}",
                f"{number(m['kl_before'], '.3g')} → {number(m['kl_after'], '.3g')}",
                number(m["rho_l1"]),
            )
    return table


def _selection_table(selecting: Mapping[str, Mapping[str, Any]]) -> Table:
    dev = any(selection["metric"] == LM_EVAL for selection in selecting.values())
    table = Table(
        title="select: every candidate on the held-out prompts"
        + (" or the dev split (lm_eval)" if dev else "")
        + " (✓ kept)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    columns = ("task", "candidate", "agreement", "KL", "ρ_L1", *(("lm_eval",) if dev else ()))
    for column in (*columns, "kept"):
        table.add_column(column, justify="left" if column in ("task", "candidate") else "right")
    for task, selection in selecting.items():
        candidates = selection["candidates"]
        for index, candidate in enumerate(candidates):
            held = candidate["held_out"]
            chosen = index == selection["chosen"]
            table.add_row(
                task if index == 0 else "",
                candidate_label(candidate, candidates),
                number(held["agreement"]),
                number(held["kl"], ".3g"),
                number(held["rho_l1"]),
                *((number(held.get(LM_EVAL)),) if dev else ()),
                "diverged" if "diverged" in candidate else f"✓ by {selection['metric']}" * chosen,
            )
    return table
