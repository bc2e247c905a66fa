"""The model card, one renderer for both folders a run gives people: the merged folder's
``README.md`` section and an export's ``README.md``.

The merged folder's section sits between two HTML comments, so re-running the surgery replaces it
instead of stacking a second one. A folder without a README (``calibrate`` on a merge made without
a card) gets mergekit's own card, rebuilt from ``mergekit_config.yml``, before the section is
added. The card is updated after ``surgery/`` is in place, so a card that cannot be read as
expected (front matter that is not YAML, a recipe mergekit cannot rebuild a card from) is a
warning: the section is added to what is there, and the surgery stands (docs/surgery-block.md).

An export's card says where the folder comes from, what it corrects and how to load, serve and
evaluate it: a module export (one task's module, or the routed modules), a plain export or the
joint one. Both cards share the tags, the ρ_L1 note, the joint correction's rows and the recipe
mergekit recorded.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from mergekit_darts.calibrate.selection import candidate_label
from mergekit_darts.config.schema import LM_EVAL
from mergekit_darts.correction.darts_correction import PLAIN_KINDS
from mergekit_darts.folder.fs import write_text
from mergekit_darts.folder.manifest import (
    RECIPE,
    REPORT_DIR,
    SURGERY_DIR,
    JointEntry,
    Manifest,
    RouterEntry,
    TaskEntry,
)
from mergekit_darts.messages import first_line
from mergekit_darts.present.rows import (
    joint_results,
    loss_label,
    number,
    router_rows,
    verdict_line,
)
from mergekit_darts.task_map import JOINT, ROUTED

LOG = logging.getLogger("mergekit_darts")
START = "<!-- mergekit-darts:surgery -->"
END = "<!-- /mergekit-darts:surgery -->"
TAGS = ("darts", "representation-surgery")
RHO_L1_NOTE = (
    "ρ_L1 = 1 − Σδ_after / Σδ_before on the calibration tokens: the share of the merged model's "
    "hidden-state gap to the target that the module removes (higher is better)."
)


# ---- the merged folder's card ------------------------------------------------------------------


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
            f"{entry.module} | {loss_label(entry)} | {entry.loss_positions} | {prompts} | "
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
                f"| `{task}` | {label} | {number(numbers[0])} | {number(numbers[1], '.3g')} | "
                f"{number(numbers[2])} | {before if index == 0 else ''} | {kept} |"
            )
    if not rows:
        return []
    won = [verdict_line(task, entry, card=True) for task, entry in tasks.items()]
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
        return (
            f"{number(held['all']['agreement_before'])} / {number(held['all']['kl_before'], '.3g')}"
        )
    none = next((c for c in selection["candidates"] if c["module"] == "none"), None)
    if none is None:
        return "–"
    return f"{number(none['held_out']['agreement'])} / {number(none['held_out']['kl'], '.3g')}"


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
        *(f"| {' | '.join(row)} |" for row in router_rows(router)),
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
    for label, task, r in joint_results(selection):
        rows.append(
            f"| {label} | `{task}` | {number(r['mean'], '.3g')} | {number(r['none'], '.3g')} | "
            f"{r['better']} / {r['worse']} of {r['prompts']} | {r['p_better']:.3g} | "
            f"{r['p_worse']:.3g} |"
        )
    return rows


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
    text, config, error = _recipe(folder)
    if text is None:
        return f"# {folder.name}\n"
    if config is None:  # YAML or mergekit's validation: the card is not worth the run
        LOG.warning(
            "%s: mergekit cannot rebuild its model card from it (%s); README.md gets a bare "
            "title and the surgery section",
            folder / RECIPE,
            first_line(str(error))[:200],
        )
        return f"# {folder.name}\n"
    from mergekit.card import generate_card

    return generate_card(config=config, config_yaml=text, name=folder.name)


def _recipe(folder: Path) -> tuple[str | None, Any, Exception | None]:
    """The merge YAML mergekit left in ``folder`` (None without one) and mergekit's reading of it
    (its ``MergeConfiguration``; None, with the error, where mergekit cannot read it)."""
    file = folder / RECIPE
    if not file.is_file():
        return None, None, None
    text = file.read_text(encoding="utf-8")
    try:
        from mergekit.config import MergeConfiguration

        return text, MergeConfiguration.model_validate(yaml.safe_load(text)), None
    except Exception as err:  # YAML or mergekit's validation
        return text, None, err


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


# ---- an export's card --------------------------------------------------------------------------


class _Source(NamedTuple):
    """What an export's card is written from: the merged folder, its config.json, its manifest."""

    out: Path
    config: Mapping[str, Any]
    manifest: Manifest


def export_card(
    out: Path, config: Mapping[str, Any], manifest: Manifest, task: str, name: str
) -> str:
    """Markdown for an export's README.md (``task`` of the merged folder ``out``, shown as
    ``name``): where it comes from, what it corrects, how to use it."""
    source = _Source(out, config, manifest)
    _, _, models = _merge_config(source.out)
    hub_models = [m for m in models if _looks_like_hub_id(m)]
    front = {
        "library_name": "transformers",
        "tags": [*TAGS, "mergekit", "merge"],
        **({"base_model": hub_models} if hub_models else {}),
    }
    if task == JOINT:
        return _joint_card(source, name, front)
    if task != ROUTED and source.manifest.tasks[task].module in PLAIN_KINDS:
        return _plain_card(source, task, name, front)
    names, intro, extra = _module_intro(source, task)
    eval_tasks = [t for n in names for t in source.manifest.tasks[n].eval_tasks]
    lm_eval_tasks = ",".join(dict.fromkeys(eval_tasks)) or "TASKS"
    rows = []
    for n in names:
        entry = source.manifest.tasks[n]
        rho = entry.metrics.get("rho_l1")  # absent in hand-made surgery folders
        rows.append(
            f"| `{n}` | `{entry.target or ''}` | {', '.join(entry.eval_tasks)} | {entry.module} | "
            f"{entry.loss or ''} | {entry.rank} | {entry.max_positions} | "
            f"{'—' if rho is None else f'{rho:.3f}'} |"
        )
    lines = [
        *_heading(front, name),
        intro,
        "",
        "| task | target | lm-eval tasks | module | loss | rank | max positions | ρ_L1 |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *(extra + [""] if extra else []),
        RHO_L1_NOTE,
        "",
        "## Load",
        "",
        "`trust_remote_code=True` is required: the folder's model type is `darts`, and without the "
        "shipped code the model would load without its correction. Only torch and transformers "
        "are needed (not mergekit-darts).",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)',
        "```",
        "",
        "(The tokenizer is the merge's own; the flag only spares AutoTokenizer a prompt about "
        "the folder's custom config.)",
        "",
        "## Serve",
        "",
        "```sh",
        'pip install "mergekit-darts[vllm]"   # the vLLM plugin that applies the correction',
        f"vllm serve {name}",
        "```",
        "",
        "## Evaluate",
        "",
        "```sh",
        f"lm_eval --model hf --model_args pretrained={name},trust_remote_code=True "
        f"--tasks {lm_eval_tasks}",
        f"lm_eval --model vllm --model_args pretrained={name} --tasks {lm_eval_tasks}",
        "```",
    ]
    return "\n".join(lines + _source_lines(source.out)) + "\n"


def _module_intro(source: _Source, task: str) -> tuple[list[str], str, list[str]]:
    """A module export's tasks, its opening paragraph and any extra lines: one task's module, or
    every routed task's behind the router."""
    arch = source.config["architectures"][0]
    if task == ROUTED:
        router = source.manifest.router
        names = list(router.tasks)
        intro = (
            f"The merged model `{source.out.name}` with the DARTS surgery modules of tasks "
            f"{', '.join(f'`{n}`' for n in names)} behind one router: per token, a gate "
            "`softmax(W h + b)` on the final hidden state `h` (the LM head's input) weighs the "
            "tasks' float32 corrections"
            + (", plus a last class for text that needs none" if router.background else "")
            + ", so each domain gets its correction without being told which domain it is. "
            "Applied at every forward call by the shipped `modeling_darts.py`, which builds on "
            f"transformers' own `{arch}`."
        )
        accuracy = (router.held_out or {}).get("token_accuracy")
        extra = (
            [f"Router: classes {', '.join(router.classes)}"
             + ("" if accuracy is None else f"; held-out token accuracy {accuracy:.3f}") + "."]
        )  # fmt: skip
        return names, intro, extra
    module = source.manifest.tasks[task].module
    intro = (
        f"The merged model `{source.out.name}` with the DARTS surgery module of task `{task}`: "
        "a small float32 correction of the final hidden state (the LM head's input), applied "
        "at every forward call by the shipped `modeling_darts.py`, which builds on "
        f"transformers' own `{arch}`."
    )
    none = ["Its module is `none`: the correction is the identity (the plain merge)."]
    return [task], intro, none if module == "none" else []


def _heading(front: dict[str, Any], name: str) -> list[str]:
    """The card's YAML front matter and title."""
    return ["---", yaml.safe_dump(front, sort_keys=False).rstrip("\n"), "---", f"# {name}", ""]


def _source_lines(out: Path) -> list[str]:
    """The card's "Source merge" section: the models and the merge YAML, when recorded."""
    merge_yaml, base, models = _merge_config(out)
    if not merge_yaml:
        return []
    lines = ["", "## Source merge", ""]
    lines += [f"- `{m}`" + (" (base)" if i == 0 and base else "") for i, m in enumerate(models)]
    return lines + ["", "```yaml", merge_yaml.rstrip("\n"), "```"]


def _plain_card(source: _Source, task: str, name: str, front: dict[str, Any]) -> str:
    """The card of a plain export: an ordinary checkpoint of the merge's architecture."""
    entry = source.manifest.tasks[task]
    lines = [
        *_heading(front, name),
        f"The merged model `{source.out.name}` with the DARTS plain correction of task `{task}` "
        f"(module `{entry.module}`) {_folded(source, entry.module)}",
        "",
        *_plain_usage(name, entry.eval_tasks),
    ]
    return "\n".join(lines + _source_lines(source.out)) + "\n"


def _joint_card(source: _Source, name: str, front: dict[str, Any]) -> str:
    """The card of the joint export: one plain checkpoint for every task, and each task's
    verdict."""
    entry = source.manifest.joint
    names = ", ".join(f"`{t}`" for t in entry.tasks)
    selection = entry.selection
    if entry.module == "none":
        intro = (
            f"The merged model `{source.out.name}` as it is: the verdict kept no joint correction "
            f"of tasks {names}, so this folder is the merge, an ordinary checkpoint."
        )
    else:
        intro = (
            f"The merged model `{source.out.name}` with the DARTS joint plain correction of tasks "
            f"{names} (module `{entry.module}`, fitted on every task's prompts at once: one model "
            f"for every task, no task id) {_folded(source, entry.module)}"
        )
    eval_tasks = [t for n in entry.tasks for t in source.manifest.tasks[n].served(n)]
    lines = [
        *_heading(front, name),
        intro,
        "",
        f"Verdict: {selection.get('verdict', '')}",
        "",
        *joint_rows(selection),
        "",
        *_plain_usage(name, list(dict.fromkeys(eval_tasks))),
    ]
    return "\n".join(lines + _source_lines(source.out)) + "\n"


def _folded(source: _Source, kind: str) -> str:
    """Where a plain kind lives in the checkpoint, and what that means for serving it."""
    arch = source.config["architectures"][0]
    where = (
        "folded into the LM head (`W (I - M)`; no bias is added: a head without one gets none, "
        "and a head bias, as Phi's, is kept exactly)"
        if kind == "head"
        else "folded into the final norm's weight (a per-channel scale; a LayerNorm's bias, as "
        "Phi's, is scaled with it)"
    )
    untied = (
        " The merge ties its LM head to the input embedding; this folder unties it into its own "
        "`lm_head.weight` (`tie_word_embeddings: false`), which adds vocabulary x hidden "
        "parameters."
        if kind == "head" and source.config.get("tie_word_embeddings")
        else ""
    )
    return (
        f"{where}. It is an ordinary `{arch}` checkpoint: no custom code, no extra tensors, so it "
        "serves in any engine (stock transformers, vLLM, llama.cpp / GGUF, SGLang, TGI) exactly "
        f"as the merge does.{untied}"
    )


def _plain_usage(name: str, eval_tasks: list[str]) -> list[str]:
    tasks = ",".join(eval_tasks) or "TASKS"
    return [
        "## Load, serve, evaluate",
        "",
        "```sh",
        f'python -c "from transformers import AutoModelForCausalLM; '
        f"AutoModelForCausalLM.from_pretrained('{name}')\"",
        f"vllm serve {name}",
        f"python convert_hf_to_gguf.py {name}   # llama.cpp",
        f"lm_eval --model hf --model_args pretrained={name} --tasks {tasks}",
        "```",
    ]


def _merge_config(out: Path) -> tuple[str | None, bool, list[str]]:
    """The merge YAML mergekit left in the folder, whether it has a base model, and the models it
    names (base model first)."""
    text, config, _ = _recipe(out)
    if config is None:  # an unreadable record only costs the card its model list
        return text, False, []
    base = [str(config.base_model.model.path)] if config.base_model else []
    others = sorted({str(m.model.path) for m in config.referenced_models()} - set(base))
    return text, bool(base), base + others


def _looks_like_hub_id(path: str) -> bool:
    """``org/name`` that is not a local folder (mergekit's own test asks the Hub, offline here)."""
    return path.count("/") == 1 and path[0] not in "./~" and not Path(path).exists()
