"""Figure 1 over whole answers: δ_t by token position on prompt + the expert's own answer.

The calibration diagnostics (demo.run's bias_figures) stop where the calibration prompts stop,
yet a model answers at later positions, where the causal mask has had longest to accumulate the
merge's error and where a DARTS position table trained on prompts alone has no rows (positions
past the longest calibrated one get no position correction, paper section 7). This study feeds
each domain's held-out evaluation prompts (no module trained on them) followed by the target
expert's greedy completion to the expert and to the merged model, teacher-forced on the same
tokens, and measures δ_t = ‖h − h*‖₁ / H (paper eq. 2) before surgery and after each domain's
Standard + L1, DARTS and (when the merge has it) DARTS-calibrated-on-completions module.

Everything is the product's own code: prompts are read and tokenized as calibration reads and
tokenizes them, completions are calibration's greedy continuation, hidden states its capture,
and the modules are loaded by ``load_surgery`` and applied by ``measure_bias`` with the position
rule of ``correction.darts_correction``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import yaml
from matplotlib.figure import Figure

from demo.configs import DARTS, STANDARD_L1, VARIANTS, lm_eval_task, surgery_task
from demo.domains import DOMAIN_NAMES
from demo.family_io import FamilyPaths
from mergekit_darts.calibrate.capture import Captured, capture
from mergekit_darts.calibrate.continuation import (
    completion_mask,
    eos_token_ids,
    greedy_completions,
)
from mergekit_darts.calibrate.data import read_prompts, tokenize_prompts
from mergekit_darts.calibrate.runtime import Runtime, load_model, merged_tokenizer, pad_id, release
from mergekit_darts.calibrate.train import measure_bias
from mergekit_darts.config import CalibrationConfig
from mergekit_darts.config.schema import default
from mergekit_darts.correction.metrics import rho_from_deltas
from mergekit_darts.errors import ReportError
from mergekit_darts.folder.artifacts import load_surgery, read_manifest
from mergekit_darts.folder.fs import atomic_file, write_text
from mergekit_darts.folder.manifest import Manifest, surgery_dir
from mergekit_darts.present.plots import as_array, position_mean

# Declared before any number was seen: the paper compares positions 0-50 with 100-256; the long
# family's sequences end near 130-170, so early is the first 32 positions of the sequence and late
# every position from 100 on (sequence positions, the position table's index).
EARLY_POSITIONS = 32
LATE_FROM = 100
BEFORE = "before surgery"
SUFFIXES = ("png", "json", "md")  # the files position_figures writes per merge


def _suffix(overrides: dict[str, Any], continued: bool) -> str:
    """The task-name suffix of the demo variant with these overrides (demo.configs owns them)."""
    for variant in VARIANTS:
        if variant.overrides == overrides and bool(variant.continuation_tokens) == continued:
            return variant.suffix
    raise ValueError(f"demo.configs has no variant {overrides} (continued={continued})")


CONT_SUFFIX = _suffix(DARTS, continued=True)
CURVES = {  # label -> task-name suffix; the last one is drawn only when the merge has it
    "Standard + L1": _suffix(STANDARD_L1, continued=False),
    "DARTS": _suffix(DARTS, continued=False),
    "DARTS +completions": CONT_SUFFIX,
}
COLOURS = {BEFORE: "tab:red", "Standard + L1": "tab:orange", "DARTS": "tab:blue"}
COLOURS["DARTS +completions"] = "tab:green"


@dataclass
class DomainBias:
    """One domain's per-token bias [N, T] for each curve, and where each position table ends."""

    domain: str
    delta: dict[str, np.ndarray]  # curve label -> δ_t per sample and position
    mask: np.ndarray  # [N, T] real tokens
    completion: np.ndarray  # [N, T] the expert's completion tokens
    table_length: dict[str, int]  # pos_corr curve -> rows of its table that correct (nonzero)
    sequences: list[list[int]]  # prompt + completion token ids, the rows of the arrays


def table_length(position_bias: torch.Tensor) -> int:
    """Positions ``[0, n)`` a pos_corr table corrects: 1 + its last nonzero row (0: none).

    Rows past the longest calibrated position never receive a gradient and stay at their zero
    initialisation, so this is the calibration's reach as the module itself records it."""
    rows = np.flatnonzero(np.abs(as_array(position_bias)).sum(-1) > 0)
    return int(rows[-1]) + 1 if rows.size else 0


def generation_limit(family: FamilyPaths, domain: str) -> int:
    """``max_gen_toks`` of the domain's lm-eval task file (demo.family_io writes it)."""
    path = family.tasks / f"{lm_eval_task(domain)}.yaml"
    try:
        return int(yaml.safe_load(path.read_text())["generation_kwargs"]["max_gen_toks"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError) as err:
        raise ReportError(
            f"cannot read the evaluation's generation limit from {path} ({type(err).__name__}): "
            "build the family with demo.run, or pass max_new_tokens"
        ) from None


def _tasks(manifest: Manifest, domain: str, cont_suffix: str) -> dict[str, str]:
    """Curve label -> task name for one domain; the +completions task only when present."""
    suffixes = {**CURVES, "DARTS +completions": cont_suffix}
    tasks = {label: surgery_task(domain) + suffix for label, suffix in suffixes.items()}
    if tasks["DARTS +completions"] not in manifest.tasks:
        del tasks["DARTS +completions"]
    missing = [t for t in tasks.values() if t not in manifest.tasks]
    if missing:
        raise ReportError(
            f"the merge's surgery has no task {', '.join(missing)} (it has "
            f"{', '.join(manifest.tasks)}): the position study needs each domain's Standard + L1 "
            "and DARTS tasks, as demo.configs writes them"
        )
    return tasks


def position_bias(
    merged: Path,
    family: FamilyPaths,
    *,
    split: Literal["eval", "calib"] = "eval",
    num_samples: int = CalibrationConfig.model_fields["num_samples"].default,
    max_new_tokens: int | None = None,
    cont_suffix: str = CONT_SUFFIX,
    batch_size: int = default("batch_size"),
    device: str = "cpu",
    progress: bool = False,
) -> dict[str, DomainBias]:
    """δ_t of every domain of ``merged`` (a `mergekit-yaml` output with its surgery folder).

    ``split``: the domain's evaluation items (held out from every module: the default) or its
    calibration prompts. Each sequence is the prompt followed by the target expert's greedy
    completion of up to ``max_new_tokens`` tokens (default: the family's evaluation limit, from
    its lm-eval task files), the whole answer as the evaluation generates it; the expert stops at
    its end-of-turn, so late positions average the samples that reach them. ``cont_suffix``
    names the DARTS task calibrated on completions, drawn when the merge has it. One model in
    memory at a time: each expert (generate, capture), then the merged model once. Every input
    is checked (tasks, prompt files, generation limits, modules) before a model loads.
    """
    folder = surgery_dir(merged)
    manifest = read_manifest(folder)
    tasks = {d: _tasks(manifest, d, cont_suffix) for d in DOMAIN_NAMES}
    files = {
        d: (family.eval_file if split == "eval" else family.calib_file)(d) for d in DOMAIN_NAMES
    }
    texts = {
        d: read_prompts(
            CalibrationConfig(path=str(files[d]), field="prompt", num_samples=num_samples),
            f"position study ({split})",
            f"domain {d!r}",
        ).texts
        for d in DOMAIN_NAMES
    }
    limits = {
        d: generation_limit(family, d) if max_new_tokens is None else max_new_tokens
        for d in DOMAIN_NAMES
    }
    modules = {
        d: {c: load_surgery(folder, t, weights=merged) for c, t in ts.items()}
        for d, ts in tasks.items()
    }
    tokenizer = merged_tokenizer(merged, trust_remote_code=False)
    runtime = Runtime(device, None, False, torch.float32, tokenizer, pad_id(tokenizer), progress)
    sequences, completions, targets = {}, {}, {}
    for domain in DOMAIN_NAMES:
        cal = manifest.tasks[tasks[domain]["DARTS"]].calibration  # tokenized as calibration did
        prompts = tokenize_prompts(
            tokenizer,
            texts[domain],
            max_length=cal["max_length"],
            chat_template=cal["chat_template"],
            key=f"position study {domain}",
        )
        model = load_model(str(family.experts[domain]), runtime)
        answers = greedy_completions(
            model,
            prompts,
            max_new_tokens=limits[domain],
            eos_ids=eos_token_ids(model, tokenizer),
            pad_id=runtime.pad_id,
            batch_size=batch_size,
            progress=progress,
            desc=f"{domain}: expert answers",
        )
        sequences[domain] = [p + a for p, a in zip(prompts, answers, strict=True)]
        completions[domain] = completion_mask([len(p) for p in prompts], [len(a) for a in answers])
        targets[domain] = _capture(
            model, sequences[domain], runtime, batch_size, f"{domain}: expert"
        )
        del model
        release(device)
    model = load_model(str(merged), runtime)
    merged_states = {
        d: _capture(model, sequences[d], runtime, batch_size, f"{d}: merged") for d in DOMAIN_NAMES
    }
    del model
    release(device)
    out = {}
    for domain in DOMAIN_NAMES:
        merged_cap, target_cap = merged_states[domain], targets[domain]
        delta: dict[str, np.ndarray] = {}
        lengths: dict[str, int] = {}
        for label, module in modules[domain].items():
            before, after, _ = measure_bias(module, merged_cap, target_cap, merged_cap.mask)
            delta.setdefault(BEFORE, as_array(before))
            delta[label] = as_array(after)
            if module.kind == "pos_corr":
                lengths[label] = table_length(module.position_bias)
        out[domain] = DomainBias(
            domain,
            delta,
            as_array(merged_cap.mask.cpu()) > 0,
            as_array(completions[domain]) > 0,
            lengths,
            sequences[domain],
        )
    return out


def _capture(
    model: torch.nn.Module, sequences: list[list[int]], runtime: Runtime, batch_size: int, desc: str
) -> Captured:
    return capture(
        model,
        sequences,
        batch_size=batch_size,
        cache_dtype=runtime.cache_dtype,
        cache_device=runtime.device,
        pad_id=runtime.pad_id,
        desc=desc,
        progress=runtime.progress,
    )


# --- numbers ------------------------------------------------------------------------------------


def _mean(values: np.ndarray, mask: np.ndarray) -> float | None:
    return float(values[mask].mean()) if mask.any() else None


def summarize(
    study: dict[str, DomainBias], early: int = EARLY_POSITIONS, late_from: int = LATE_FROM
) -> dict[str, Any]:
    """Per domain and curve: mean δ over the early positions ``[0, early)`` and the late ones
    ``[late_from, ...)`` (means over tokens), late / early, prompt and completion means; for each
    surgery curve ρ_L1 inside and past the DARTS table (``1 − Σ after / Σ before``)."""
    domains = {}
    for domain, bias in study.items():
        width = bias.mask.shape[1]
        position = np.broadcast_to(np.arange(width), bias.mask.shape)
        early_mask = bias.mask & (position < early)
        late_mask = bias.mask & (position >= late_from)
        table = bias.table_length.get("DARTS", 0)
        inside, past = bias.mask & (position < table), bias.mask & (position >= table)
        before = bias.delta[BEFORE]
        curves = {}
        for label, delta in bias.delta.items():
            early_mean, late_mean = _mean(delta, early_mask), _mean(delta, late_mask)
            curves[label] = {
                "early": early_mean,
                "late": late_mean,
                "late_over_early": late_mean / early_mean if early_mean and late_mean else None,
                "prompt": _mean(delta, bias.mask & ~bias.completion),
                "completion": _mean(delta, bias.completion),
            }
            if label != BEFORE:
                curves[label]["rho_l1_inside_darts_table"] = rho_from_deltas(before, delta, inside)
                curves[label]["rho_l1_past_darts_table"] = rho_from_deltas(before, delta, past)
        domains[domain] = {
            "prompts": len(bias.sequences),
            "positions": width,
            "samples_reaching_late": int(late_mask.any(axis=1).sum()),
            "early_tokens": int(early_mask.sum()),
            "late_tokens": int(late_mask.sum()),
            "completion_tokens": int(bias.completion.sum()),
            "table_length": bias.table_length,
            "curves": curves,
        }
    return {"early": [0, early], "late_from": late_from, "domains": domains}


def markdown(summary: dict[str, Any], title: str) -> str:
    """The summary as a table per domain, and one line saying how δ before surgery grows."""
    early, late = summary["early"][1], summary["late_from"]
    lines = [
        f"## {title}: δ_t by position over prompt + the expert's answer",
        "",
        f"δ_t = ‖h − h*‖₁ / H per token; early = positions 0–{early - 1}, late = positions ≥ "
        f"{late} (means over tokens); ρ_L1 inside / past the DARTS position table "
        "(its correcting rows).",
    ]

    def f(value: float | None, digits: int = 4) -> str:
        return "–" if value is None else f"{value:.{digits}f}"

    for domain, numbers in summary["domains"].items():
        tables = ", ".join(f"{k}: {v}" for k, v in numbers["table_length"].items())
        lines += [
            "",
            f"### {domain} ({numbers['prompts']} prompts, {numbers['samples_reaching_late']} reach "
            f"position {late}; position tables: {tables})",
            "",
            "| curve | early | late | late/early | prompt | completion | ρ_L1 in table "
            "| ρ_L1 past table |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, c in numbers["curves"].items():
            lines.append(
                f"| {label} | {f(c['early'])} | {f(c['late'])} | {f(c['late_over_early'], 2)} | "
                f"{f(c['prompt'])} | {f(c['completion'])} | "
                f"{f(c.get('rho_l1_inside_darts_table'), 3)} | "
                f"{f(c.get('rho_l1_past_darts_table'), 3)} |"
            )
        ratio = numbers["curves"][BEFORE]["late_over_early"]
        if ratio is not None:
            lines += ["", f"Before surgery, late δ is {ratio:.2f}× early δ (paper, 7B: 2–3×)."]
    return "\n".join(lines) + "\n"


# --- figure -------------------------------------------------------------------------------------


def answer_aligned(
    values: np.ndarray, bias: DomainBias
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean of ``values`` [N, T] by offset from each sample's first answer token (negative: its
    prompt), and the samples at each offset: what the answer adds, apart from how far it sits."""
    lengths = bias.mask.sum(axis=1)
    starts = [
        int(np.argmax(row)) if row.any() else int(n)
        for row, n in zip(bias.completion, lengths, strict=True)
    ]
    first, last = -max(starts), int(max(n - s for n, s in zip(lengths, starts, strict=True)))
    shifted = np.full((len(starts), last - first), np.nan)
    for row, (start, n) in enumerate(zip(starts, lengths, strict=True)):
        shifted[row, -start - first : n - start - first] = values[row, :n]
    mean, counts = position_mean(np.nan_to_num(shifted), ~np.isnan(shifted))
    return np.arange(first, last), mean, counts


def plot_position_bias(study: dict[str, DomainBias], path: Path, title: str) -> Path:
    """One column per domain. Top: mean δ_t by sequence position for each curve, the samples
    reaching each position (grey bars, right axis) and a dotted line where each position table
    ends. Bottom: the same curves by offset from the first answer token."""
    fig = Figure(figsize=(5.5 * len(study), 8))
    axes = fig.subplots(2, len(study), sharey=True, squeeze=False)
    for column, (domain, bias) in enumerate(study.items()):
        top, bottom = axes[0, column], axes[1, column]
        x = np.arange(bias.mask.shape[1])
        _counts(top, x, bias.mask.sum(axis=0))
        for label, delta in bias.delta.items():
            mean, _ = position_mean(delta, bias.mask)
            top.plot(x, mean, label=label, color=COLOURS[label])
            offsets, aligned, counts = answer_aligned(delta, bias)
            bottom.plot(offsets, aligned, label=label, color=COLOURS[label])
        _counts(bottom, offsets, counts)
        for label, length in bias.table_length.items():
            top.axvline(length, color=COLOURS[label], linestyle=":", label=f"{label} table ends")
        bottom.axvline(0, color="k", linewidth=0.8)
        top.set_title(f"{title}, {domain}")
        top.set_xlabel("token position (prompt + expert's answer)")
        bottom.set_xlabel("tokens after the answer's start (negative: prompt)")
    for row in axes:
        row[0].set_ylabel("mean δ_t = ‖h − h*‖₁ / H")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=3, bbox_to_anchor=(0.5, 0.0))
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    return path


def _counts(ax: Any, x: np.ndarray, counts: np.ndarray) -> None:
    """Grey bars of the samples at each x on a right axis, drawn behind ``ax``'s curves."""
    twin = ax.twinx()
    twin.bar(x, counts, color="#cccccc", alpha=0.4, width=1.0)
    twin.set_ylabel("samples")
    ax.set_zorder(twin.get_zorder() + 1)
    ax.patch.set_visible(False)


def position_figures(out: Path, merged: Path, family: FamilyPaths, **study: Any) -> list[Path]:
    """The study of one merge (``position_bias`` keyword arguments in ``study``) as
    ``out/figures/<merge>_position_bias.{png,json,md}``; returns those paths."""
    title = merged.name
    bias = position_bias(merged, family, **study)
    png, numbers, text = (out / "figures" / f"{title}_position_bias.{x}" for x in SUFFIXES)
    summary = summarize(bias)
    plot_position_bias(bias, png, title)
    write_text(numbers, json.dumps(summary, indent=2) + "\n")
    write_text(text, markdown(summary, title))
    return [png, numbers, text]
