"""How a surgery run is shown to people: a section of the model card and a table in the terminal.

The card section sits between two HTML comments, so re-running the surgery replaces it instead of
stacking a second one. A folder without a README (``calibrate`` on a merge made without a card)
gets mergekit's own card, rebuilt from ``mergekit_config.yml``, before the section is added.

The card is updated after ``surgery/`` is in place, so a card that cannot be read as expected
(front matter that is not YAML, a recipe mergekit cannot rebuild a card from) is a warning: the
section is added to what is there, and the surgery stands (docs/surgery-block.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from rich import box
from rich.console import Console
from rich.table import Table

from mergekit_darts.calibrate.selection import candidate_label
from mergekit_darts.config.schema import LM_EVAL
from mergekit_darts.fs import write_text
from mergekit_darts.manifest import (
    REPORT_DIR,
    SURGERY_DIR,
    JointEntry,
    Manifest,
    RouterEntry,
    TaskEntry,
)
from mergekit_darts.messages import first_line

LOG = logging.getLogger("mergekit_darts")
START = "<!-- mergekit-darts:surgery -->"
END = "<!-- /mergekit-darts:surgery -->"
TAGS = ("darts", "representation-surgery")
RHO_L1_NOTE = (
    "ρ_L1 = 1 − Σδ_after / Σδ_before on the calibration tokens: the share of the merged model's "
    "hidden-state gap to the target that the module removes (higher is better)."
)


def update_model_card(folder: str | Path, manifest: Manifest) -> Path:
    """Add (or replace) the surgery section of ``folder/README.md``; returns its path."""
    folder = Path(folder)
    readme = folder / "README.md"
    text = readme.read_text(encoding="utf-8") if readme.is_file() else _mergekit_card(folder)
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head.rstrip("\n") + rest.split(END, 1)[1]
    text = _with_tags(text.rstrip("\n"), readme)
    text += "\n\n" + surgery_section(manifest, folder.name) + "\n"
    write_text(readme, text)
    return readme


def report_link_markdown(folder_name: str = "<folder>") -> str:
    """The card's line pointing at the report (the card sits next to ``surgery/``)."""
    return (
        "Diagnostics (δ_t heat maps before/after surgery, bias and entropy by position, loss "
        f"curves): [surgery report]({SURGERY_DIR}/{REPORT_DIR}/report.md), written by "
        f"`mergekit-darts report {folder_name}`."
    )


def surgery_section(manifest: Manifest, name: str) -> str:
    """Markdown: what each module serves, how much bias it removed, how to evaluate with it."""
    tasks = manifest.tasks
    rows = []
    for task, entry in tasks.items():
        cal, metrics = entry.calibration, entry.metrics
        prompts = f"{cal['num_prompts']} from `{cal['source']}`"
        if cal.get("continuation_tokens"):
            prompts += f" + target completions (≤ {cal['continuation_tokens']} tokens)"
        rows.append(
            f"| `{task}` | `{entry.target}` | {', '.join(entry.eval_tasks)} | "
            f"{entry.module} | {_loss(entry)} | {entry.loss_positions} | {prompts} | "
            f"{metrics['rho_l1']:.3f} |"
        )
    first = next(iter(tasks))
    every_eval_task = ",".join(t for entry in tasks.values() for t in entry.eval_tasks)
    return "\n".join(
        [
            START,
            "## DARTS surgery",
            "",
            "This folder carries DARTS surgery modules in `surgery/`: small corrections of the "
            "final hidden state (the input of the LM head), one per task, each calibrated against "
            "that task's fine-tuned model. The merged weights above are unchanged; the correction "
            "is applied at inference by `mergekit_darts.apply_surgery` or lm-eval's `hf-darts`.",
            "",
            "| task | target | lm-eval tasks | module | loss | positions | calibration | ρ_L1 |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            f"{RHO_L1_NOTE} `surgery/manifest.json` holds the settings, prompt hashes, loss "
            "curves and timings.",
            "",
            report_link_markdown(name),
            "",
            *_selection_markdown(tasks),
            *_router_markdown(manifest.router, name),
            *_joint_markdown(manifest.joint, name),
            "### Evaluate",
            "",
            "```sh",
            "pip install mergekit-darts",
            f"lm_eval --model hf-darts --model_args pretrained={name},surgery={first} "
            f"--tasks {','.join(tasks[first].eval_tasks)}",
            "# one module per request, chosen from each lm-eval task's name:",
            f"lm_eval --model hf-darts --model_args pretrained={name},surgery=auto "
            f"--tasks {every_eval_task}",
            "```",
            "",
            "### Use from Python",
            "",
            "```python",
            "from transformers import AutoModelForCausalLM",
            "from mergekit_darts import apply_surgery",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{name}")',
            f'handle = apply_surgery(model, "{name}/surgery", task="{first}")  # handle.remove()',
            "```",
            END,
        ]
    )


def _selection_markdown(tasks: Mapping[str, TaskEntry]) -> list[str]:
    """Held-out numbers and, for tasks with ``select``, every candidate and which one was kept."""
    rows = []
    for task, entry in tasks.items():
        held = entry.held_out
        selection = entry.selection
        if held is None and selection is None:
            continue
        candidates = selection["candidates"] if selection else [None]
        for index, candidate in enumerate(candidates):
            if candidate is None:  # a fixed task measured on held-out prompts
                label = candidate_label(entry.model_dump(), [])
                metrics = held["all"]
                numbers = [metrics["agreement_after"], metrics["kl_after"], metrics["rho_l1"]]
                kept = "saved"
            else:
                label = candidate_label(candidate, candidates)
                numbers = [candidate["held_out"][k] for k in ("agreement", "kl", "rho_l1")]
                kept = f"✓ by {selection['metric']}" if index == selection["chosen"] else ""
                kept = "diverged" if "diverged" in candidate else kept
            before = _uncorrected(held, selection)
            rows.append(
                f"| `{task}` | {label} | {_number(numbers[0])} | {_number(numbers[1], '.3g')} | "
                f"{_number(numbers[2])} | {before if index == 0 else ''} | {kept} |"
            )
    if not rows:
        return []
    won = [_verdict_line(task, entry, card=True) for task, entry in tasks.items()]
    won = [line for line in won if line]
    refit = any((e.selection or {}).get("refit") for e in tasks.values())
    return [
        "### Held-out measurement and selection",
        "",
        "Measured on calibration prompts held out from training (with `folds`: every prompt, by "
        "the modules that did not train on it; their sha256 are in the manifest): top-1 agreement of the corrected merge with the target's next token, "
        "KL(target ‖ corrected merge), ρ_L1; the merge without surgery for comparison.",
        *(
            [
                "A task with `select` trained each candidate on the other prompts and kept the "
                "best by the named metric" + (", then refit it on every prompt." if refit else ".")
            ]
            if any(e.selection for e in tasks.values())
            else []
        ),
        *(
            [
                "With a `completion_*` metric (the default verdict) the target completed each "
                "judged prompt, and a correction was kept only where a one-sided signed-rank test "
                "over those prompts said it beats no correction there."
            ]
            if any("verdict" in (e.selection or {}) for e in tasks.values())
            else []
        ),
        *(
            [
                "With `metric: lm_eval` every candidate trained on every prompt and lm-eval "
                "itself scored it on a development split of the task's eval_tasks; a correction "
                "was kept only where a one-sided exact McNemar test over those documents said it "
                "beats no correction."
            ]
            if any((e.selection or {}).get("metric") == LM_EVAL for e in tasks.values())
            else []
        ),
        "",
        "| task | correction | agreement | KL | ρ_L1 | no surgery: agreement / KL | kept |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        *([*won, ""] if won else []),
    ]


def _uncorrected(held: Mapping[str, Any] | None, selection: Mapping[str, Any] | None) -> str:
    """The merge without surgery on the judged prompts, "agreement / KL": from the held-out
    share, or (cross-fitted: no share held out) from the ``none`` candidate where there is one."""
    if held is not None:
        return f"{_number(held['all']['agreement_before'])} / {_number(held['all']['kl_before'], '.3g')}"
    none = next((c for c in selection["candidates"] if c["module"] == "none"), None)
    if none is None:
        return "–"
    return f"{_number(none['held_out']['agreement'])} / {_number(none['held_out']['kl'], '.3g')}"


def _verdict_line(task: str, entry: TaskEntry, *, card: bool) -> str | None:
    """What ``select`` kept, in one line: the held-out verdict (calibrate.verdict) where there is
    one, else a line only when ``none`` won."""
    selection = entry.selection or {}
    if "verdict" in selection:
        return f"{task}: {selection['verdict']}"
    if not _none_won(entry):
        return None
    if card:
        return f"For `{task}`, no correction (the merge as it is) won: its module is the identity."
    return (
        f"{task}: no correction (the merge as it is) won on the held-out {selection['metric']}; "
        "its module is the identity"
    )


def _none_won(entry: TaskEntry) -> bool:
    """Whether ``select`` kept the ``none`` candidate (the merge as it is)."""
    selection = entry.selection
    return bool(selection) and selection["candidates"][selection["chosen"]]["module"] == "none"


def _router_rows(router: RouterEntry) -> list[tuple[str, str, str, str, str]]:
    """(class, prompts, tokens, token accuracy, sequence accuracy): every class, then all."""
    held = router.held_out or {}
    rows = [
        (
            name,
            str(m["prompts"]),
            str(m["tokens"]),
            _number(m["token_accuracy"]),
            _number(m["sequence_accuracy"]),
        )
        for name, m in held.get("per_task", {}).items()
    ]
    if held:
        rows.append(
            (
                "all",
                str(held["prompts"]),
                str(held["tokens"]),
                _number(held["token_accuracy"]),
                _number(held["sequence_accuracy"]),
            )
        )
    return rows


def _router_markdown(router: RouterEntry | None, name: str) -> list[str]:
    """The gate of ``route:``: how often it picks the right task on held-out prompts."""
    if router is None:
        return []
    classes = ", ".join(f"`{c}`" for c in router.classes)
    return [
        "### Router",
        "",
        f"One gate weighs the corrections of every task per token (classes {classes}"
        + ("; `none`: text that gets no correction" if router.background else "")
        + "), so one model serves them all without being told the task. Measured on "
        "calibration prompts held out from its fit (the saved gate is the one measured): how "
        "often it picks the prompt's own task per token, and per prompt (the mean gate over "
        "its tokens).",
        "",
        "| class | prompts | tokens | token accuracy | prompt accuracy |",
        "|---|---|---|---|---|",
        *(f"| {' | '.join(row)} |" for row in _router_rows(router)),
        "",
        "```sh",
        f"lm_eval --model hf-darts --model_args pretrained={name},surgery=routed --tasks ...",
        "```",
        "",
    ]


def joint_rows(selection: Mapping[str, Any]) -> list[str]:
    """Markdown rows: each joint candidate's held-out result on each task against none."""
    rows = [
        f"| candidate | task | {selection.get('metric', '')} | none | better / worse of prompts | "
        "p (better) | p (worse) |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, task, r in _joint_results(selection):
        rows.append(
            f"| {label} | `{task}` | {_number(r['mean'], '.3g')} | {_number(r['none'], '.3g')} | "
            f"{r['better']} / {r['worse']} of {r['prompts']} | {r['p_better']:.3g} | "
            f"{r['p_worse']:.3g} |"
        )
    return rows


def _joint_results(selection: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, Any]]]:
    """(candidate label, task, its result on the task) for every joint candidate and task."""
    return [
        (f"{c['module']} + {c['loss']}", task, result)
        for c in selection.get("candidates", [])
        for task, result in c.get("tasks", {}).items()
    ]


def _joint_markdown(joint: JointEntry | None, name: str) -> list[str]:
    """The joint correction: one plain correction of every task, and how each task judged it."""
    if joint is None:
        return []
    kept = (
        "the verdict kept none: `surgery=joint` serves the merge as it is"
        if joint.module == "none"
        else f"kept: `{joint.module}`, which `mergekit-darts export {name} --joint DEST` folds "
        "into an ordinary checkpoint for any engine"
    )
    return [
        "### Joint correction",
        "",
        f"One plain correction fitted on every task's prompts at once, for one model that serves "
        f"every task without a task id; {kept}. {joint.selection.get('verdict', '')}",
        "",
        *joint_rows(joint.selection),
        "",
        "```sh",
        f"lm_eval --model hf-darts --model_args pretrained={name},surgery=joint --tasks ...",
        "```",
        "",
    ]


def _mergekit_card(folder: Path) -> str:
    """mergekit's card for the merge recorded in the folder, or a bare title without one."""
    config_file = folder / "mergekit_config.yml"
    if not config_file.is_file():
        return f"# {folder.name}\n"
    from mergekit.card import generate_card
    from mergekit.config import MergeConfiguration

    source = config_file.read_text(encoding="utf-8")
    try:
        config = MergeConfiguration.model_validate(yaml.safe_load(source))
    except Exception as err:  # YAML or mergekit's validation: the card is not worth the run
        LOG.warning(
            "%s: mergekit cannot rebuild its model card from it (%s); README.md gets a bare "
            "title and the surgery section",
            config_file,
            first_line(str(err))[:200],
        )
        return f"# {folder.name}\n"
    return generate_card(config=config, config_yaml=source, name=folder.name)


def _with_tags(text: str, readme: Path) -> str:
    """Add the DARTS tags to the card's YAML front matter, when it has one that is a mapping."""
    if not text.startswith("---\n") or "\n---" not in text[4:]:
        return text
    front, body = text[4:].split("\n---", 1)
    try:
        meta = yaml.safe_load(front) or {}
    except yaml.YAMLError as err:
        return _untagged(text, readme, f"is not valid YAML ({first_line(str(err))[:200]})")
    if not isinstance(meta, dict):
        return _untagged(text, readme, "is not a mapping of keys")
    tags = meta.get("tags") or []
    tags = [tags] if isinstance(tags, str) else tags
    if not isinstance(tags, list):
        return _untagged(text, readme, "has `tags:` that are not a list")
    meta["tags"] = tags + [t for t in TAGS if t not in tags]
    return "---\n" + yaml.safe_dump(meta, sort_keys=False) + "---" + body


def _untagged(text: str, readme: Path, problem: str) -> str:
    """``text`` as it is, with a warning that its front matter gets no tags."""
    LOG.warning(
        "%s: its front matter %s; the surgery section is added, the tags %s are not: fix the "
        "front matter and add them by hand",
        readme,
        problem,
        ", ".join(TAGS),
    )
    return text


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
            _loss(entry),
            entry.loss_positions,
            str(metrics["tokens"]),
            f"{metrics['delta_before']:.4f}",
            f"{metrics['delta_after']:.4f}",
            f"{metrics['rho_l1']:.3f}",
        ]
        if with_completion:
            row.append(_number(metrics.get("rho_l1_completion")))
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
        if line := _verdict_line(task, entry, card=False):
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
    for label, task, r in _joint_results(joint.selection):
        table.add_row(
            label,
            task,
            _number(r["mean"], ".3g"),
            _number(r["none"], ".3g"),
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
    for row in _router_rows(router):
        table.add_row(*row)
    return table


def _loss(entry: TaskEntry) -> str:
    """The loss a module trained with; ``none`` trains nothing."""
    return "–" if entry.module == "none" else str(entry.loss)


def _number(value: float | None, form: str = ".3f") -> str:
    return "–" if value is None else format(value, form)


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
                f"{_number(m['agreement_before'])} → {_number(m['agreement_after'])}",
                f"{_number(m['kl_before'], '.3g')} → {_number(m['kl_after'], '.3g')}",
                _number(m["rho_l1"]),
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
                _number(held["agreement"]),
                _number(held["kl"], ".3g"),
                _number(held["rho_l1"]),
                *((_number(held.get(LM_EVAL)),) if dev else ()),
                "diverged" if "diverged" in candidate else f"✓ by {selection['metric']}" * chosen,
            )
    return table
