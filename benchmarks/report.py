"""Markdown tables, the JSON record and the scaling plot of one benchmark run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from benchmarks.measure import MiB

# Paper appendix B, Table 8 (one A100-80GB, Llama-2-7B, N=50, T_max=512, rank 16, 500 steps).
PAPER_TABLE8 = {
    "standard": {
        "load_merged_s": 3.37,
        "load_target_s": 3.43,
        "precompute_s": 1.81,
        "train_s": 2.40,
        "total_s": 11.01,
        "peak": "29.91 GB (GPU)",
        "cache": "0.42 GB",
        "params": 131072,
        "file": "265 KB",
    },
    "pos_corr": {
        "load_merged_s": 3.46,
        "load_target_s": 3.37,
        "precompute_s": 1.87,
        "train_s": 3.15,
        "total_s": 11.85,
        "peak": "31.49 GB (GPU)",
        "cache": "0.42 GB",
        "params": 2228224,
        "file": "4.46 MB",
    },
}


def _size(n: float | None) -> str:
    if n is None or (isinstance(n, float) and not math.isfinite(n)):
        return "-"
    for unit, scale in (("GB", 1024**3), ("MB", MiB), ("KB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _s(x: float) -> str:
    return f"{x:.2f} s"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def calibration_table(cal: dict[str, Any]) -> str:
    tasks = cal["tasks"]
    kinds = list(tasks)
    paper = [k for k in kinds if k in PAPER_TABLE8]
    header = ["Phase", *kinds, *(f"paper 7B/A100 {k}" for k in paper)]

    def row(label: str, ours, theirs) -> list[Any]:
        return [label, *(ours(tasks[k]) for k in kinds), *(theirs(PAPER_TABLE8[k]) for k in paper)]

    def peak(t: dict[str, Any]) -> str:
        mem = t["memory"]
        text = f"{_size(mem['peak_rss'])} RSS (+{_size(mem['peak_rss_growth'])} over imports)"
        if mem.get("peak_cuda"):
            text += f", {_size(mem['peak_cuda'])} CUDA"
        return text

    rows = [
        row(
            "Load merged model", lambda t: _s(t["load_merged_s"]), lambda p: _s(p["load_merged_s"])
        ),
        row(
            "Load target model", lambda t: _s(t["load_target_s"]), lambda p: _s(p["load_target_s"])
        ),
        row(
            "Precompute (2 captures + entropy)",
            lambda t: _s(t["precompute_s"]),
            lambda p: _s(p["precompute_s"]),
        ),
        row(
            "Training (incl. final evaluation)",
            lambda t: _s(t["train_s"]),
            lambda p: _s(p["train_s"]),
        ),
        row(
            "Total wall-clock (run_surgery)", lambda t: _s(t["total_s"]), lambda p: _s(p["total_s"])
        ),
        row("Peak memory", peak, lambda p: p["peak"]),
        row("Hidden-state cache", lambda t: _size(t["cache_bytes"]), lambda p: p["cache"]),
        row("Surgery parameters", lambda t: f"{t['params']:,}", lambda p: f"{p['params']:,}"),
        row("Checkpoint size on disk", lambda t: _size(t["file_bytes"]), lambda p: p["file"]),
        row("Largest model (weights)", lambda t: _size(t["model_bytes"]), lambda p: "13.5 GB"),
        row("rho_L1 on the calibration set", lambda t: f"{t['rho_l1']:.3f}", lambda p: "-"),
    ]
    return _table(header, rows)


def end_to_end_table(found: dict[str, Any]) -> str:
    """Each block's stages (seconds of its last run; ``select_*`` and ``refit_s`` lie inside
    ``train_s``) and the paired ratio of the totals."""
    stages = found["stages"]
    names = list(stages)
    keys = list(dict.fromkeys(k for stage in stages.values() for k in stage))
    rows = [
        [key, *(_s(stages[n][key]) if key in stages[n] else "-" for n in names)] for key in keys
    ]
    rows.append(
        [
            f"paired ratio ({found['clock']}, median of {found['rounds']} rounds)",
            f"{found['ratio']:.2f} (quartiles {found['ratio_q1']:.2f}-{found['ratio_q3']:.2f})",
            "1.00",
        ]
    )
    return _table(["stage", *names], rows)


def phase_memory_table(cal: dict[str, Any]) -> str:
    rows = []
    for kind, task in cal["tasks"].items():
        for name, phase in task["memory"]["phases"].items():
            rows.append(
                [
                    kind,
                    name,
                    _s(phase["seconds"]),
                    _size(phase["peak_rss"]),
                    _size(phase["peak_rss_growth"]),
                ]
            )
    for name, phase in cal["naive"]["phases"].items():
        rows.append(
            [
                "naive (both loaded)",
                name,
                _s(phase["seconds"]),
                _size(phase["peak_rss"]),
                _size(phase["peak_rss_growth"]),
            ]
        )
    return _table(["Run", "Phase", "Time", "Peak RSS", "Peak growth in phase"], rows)


def ratios_table(ratios: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, r in ratios.items():
        value = r["value"]
        shown = f"{value:.3f}" if abs(value) < 1000 else f"{value:.3g}"
        target = (
            "-"
            if r["target"] is None
            else ("≤ " if r["better"] == "lower" else "≥ ") + str(r["target"])
        )
        met = {True: "met", False: "**missed**", None: "info"}[r["met"]]
        rows.append([name, shown, target, met])
    return _table(["Ratio / cost", "Measured", "Target", ""], rows)


def store_table(st: dict[str, Any]) -> str:
    """The sweep's overhead over bare training and the model loads of a block and a grid."""
    sweep, demo, grid = st["sweep"], st["demo_block"], st["grid"]
    rows = [
        [
            "8-cell sweep: capture + training",
            f"{_s(sweep['sweep_s'])} vs {_s(sweep['bare_s'])} (one capture per model + 8 bare "
            f"training loops): {sweep['ratio']:.3f}",
        ],
        [
            f"model loads, demo-shaped block ({demo['tasks']} tasks, {demo['targets']} targets)",
            f"{demo['loads']} (one per task: {demo['one_per_task']})",
        ],
        [
            f"capture loads, {grid['merges']}-merge grid ({grid['targets']} targets, "
            f"{grid['cells_per_merge']} cells per merge)",
            f"{grid['loads']} (K + M = {grid['targets'] + grid['merges']}; one per task and "
            f"cell: {grid['one_per_task']}); evaluation adds one per merge",
        ],
    ]
    table = _table(["Measure", "Value"], rows)
    return f"{st['note']}\n\n{table}" if st.get("note") else table


def inference_table(inf: dict[str, Any]) -> str:
    rows = []
    for p in inf["points"]:
        ll, gen = p["loglikelihood"], p["generate_until"]
        rows.append(
            [
                p["hidden"],
                f"{ll['hf_tok_s']:.0f}",
                f"{ll['darts_tok_s']:.0f}",
                _spread(ll),
                f"{gen['hf_tok_s']:.1f}",
                f"{gen['darts_tok_s']:.1f}",
                _spread(gen),
                f"{p['raw_forward_ratio']:.3f}",
                f"{p['raw_generate_ratio']:.3f}",
                f"{ll['hook_bound_ratio']:.4f} / {gen['hook_bound_ratio']:.4f}",
            ]
        )
    header = [
        "H",
        "loglik hf tok/s",
        "loglik hf-darts tok/s",
        "ratio [quartiles of rounds]",
        "generate hf tok/s",
        "generate hf-darts tok/s",
        "ratio [quartiles of rounds]",
        "raw forward ratio",
        "raw generate ratio",
        "1 - hook time share (loglik / generate)",
    ]
    return _table(header, rows)


def _spread(r: dict[str, Any]) -> str:
    return f"{r['ratio']:.3f} [{r['ratio_q1']:.3f}-{r['ratio_q3']:.3f}]"


def startup_table(st: dict[str, Any]) -> str:
    rows = []
    for label, c in st["commands"].items():
        top = ", ".join(f"{m} {ms:.1f}" for m, ms in c["top_hook_only_imports_ms"][:4]) or "-"
        rows.append(
            [
                label,
                c["repeats"],
                f"{c['with_hook_s']:.2f} s",
                f"{c['without_hook_s']:.2f} s",
                f"{c['wall_diff_ms']:+.0f} ms (spread {c['wall_diff_spread_ms']:.0f})",
                f"{c['cpu_diff_ms']:+.0f} ms",
                f"{c['attributed_ms']:.1f} ms",
                f"{c['hook_only_modules']}: {top}",
            ]
        )
    header = [
        "Command",
        "pairs",
        "with hook (median)",
        "DARTS_NO_HOOK=1",
        "wall diff (median)",
        "CPU diff",
        "attributed",
        "modules only with hook (ms)",
    ]
    return _table(header, rows)


def scaling_table(sc: dict[str, Any]) -> str:
    rows = [
        [
            r["axis"],
            r["N"],
            r["T"],
            r["rank"],
            r["H"],
            _s(r["load_s"]),
            _s(r["precompute_s"]),
            f"{r['train_step_ms']:.1f} ms",
            _s(r["train_s"]),
            _s(r["total_s"]),
            _size(r["cache_bytes"]),
            f"{r['params']:,}",
        ]
        for r in sc["rows"]
    ]
    header = [
        "axis",
        "N",
        "T",
        "rank",
        "H",
        "load (1 model)",
        "precompute",
        "step",
        f"train {sc['steps']} (est.)",
        "precompute + train",
        "cache",
        "params",
    ]
    return _table(header, rows)


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    parts = [
        "# mergekit-darts benchmark",
        f"Machine: {m['processor']}, {m['cpu_count']} cores, {m.get('memory_gib', '?')} GiB, "
        f"device {m['device']}{', ' + m['gpu'] if m.get('gpu') else ''}; torch {m['torch']}, "
        f"{m['torch_threads']} thread(s) ({m.get('threads_reason', '')}); "
        f"load average at start {m['loadavg_start']}, at end {m.get('loadavg_end')}. "
        f"Total runtime {results['runtime_s']:.0f} s.",
        _model_line(results["settings"]),
    ]
    if "ratios" in results:
        parts += ["## Ratios and costs vs targets", ratios_table(results["ratios"])]
    if found := notes(results):
        parts += ["### What the misses are", "\n".join(f"- {line}" for line in found)]
    if "calibration" in results:
        cal = results["calibration"]
        s = results["settings"]
        parts += [
            f"## Calibration cost per task (Table 8 layout; N={s['n']}, prompts "
            f"{s['max_length'] // 2}-{s['max_length']} tokens, rank {s['rank']}, "
            f"T_max {s['max_positions']}, {s['steps']} steps)",
            calibration_table(cal),
            "### Peak memory per phase",
            phase_memory_table(cal),
            "### Entropy memory",
            _entropy_line(cal["entropy"]),
        ]
        if "end_to_end" in cal:
            parts += [
                "### The whole post-merge step, stage by stage: the default against select: off",
                end_to_end_table(cal["end_to_end"]),
            ]
    if "store" in results:
        parts += ["## Calibrate once, train many (capture store)", store_table(results["store"])]
    if "inference" in results:
        parts += [
            "## Inference throughput, hf-darts vs hf (lm-eval classes)",
            inference_table(results["inference"]),
        ]
    if "startup" in results:
        parts += ["## Startup hook import cost", startup_table(results["startup"])]
    if "scaling" in results:
        parts += ["## Scaling of calibration cost", scaling_table(results["scaling"])]
    return "\n\n".join(parts) + "\n"


def _model_line(s: dict[str, Any]) -> str:
    if s.get("merged"):
        return f"Models: merged {s['merged']}, target {s['target']}."
    m = s["model"]
    return (
        f"Models: random Llama pairs built locally, H={m['hidden']}, {m['layers']} layers, "
        f"V={m['vocab']}, {m['dtype']} (inference: H in {list(s['inference_hidden'])})."
    )


def notes(results: dict[str, Any]) -> list[str]:
    """What the numbers say where a target is missed, computed from this run."""
    out = []
    cal = results.get("calibration")
    if cal:
        s = results["settings"]
        task = cal["tasks"].get("pos_corr") or next(iter(cal["tasks"].values()))
        mem = task["memory_ratios"]
        e = cal["entropy"]
        chunk = min(task["width"], _entropy_chunk())
        rows = 3 * chunk * e["vocab"] * 4  # log_softmax, exp, product of one [chunk, V] slice
        other = mem["excess_over_model_cache_bytes"] - e["one_batch_logits_bytes"] - rows
        # Llama-2-7B in bfloat16, the paper's cache, a batch of 8 x 512 bf16 logits, 3 fp32 rows.
        big_floor = 13.5 * 1024**3 + 0.42 * 1024**3
        big_excess = (
            8 * 512 * 32000 * 2 + 3 * min(512, _entropy_chunk()) * 32000 * 4 + max(other, 0)
        )
        out.append(
            f"Peak memory: the peak exceeds largest model + cache by "
            f"{_size(mem['excess_over_model_cache_bytes'])}: one batch of target logits "
            f"({min(s['batch_size'], task['n'])} x {task['width']} x {e['vocab']} float32 = "
            f"{_size(e['one_batch_logits_bytes'])}), the entropy's temporaries (3 x "
            f"{chunk} x {e['vocab']} float32 = {_size(rows)}) and "
            f"{_size(other)} of everything else (activations, tokenizer, allocator). None of it "
            f"grows with N, and only the activations grow with the model; with a {_size(task['model_bytes'])} model it is "
            f"{mem['peak_over_model_cache']:.2f}x, for Llama-2-7B in bfloat16 the same terms give "
            f"an estimated {(big_floor + big_excess) / big_floor:.3f}x."
        )
    st = results.get("startup")
    if st:
        for label, c in st["commands"].items():
            if c["attributed_ms"] > 20:
                mods = ", ".join(m for m, _ in c["top_hook_only_imports_ms"][:6])
                out.append(
                    f"Startup, {label}: with the hook {c['hook_only_modules']} more modules are "
                    f"imported ({c['attributed_ms']:.1f} ms of import time; largest: {mods})."
                )
    inf = results.get("inference")
    if inf:
        worst = min(
            min(p[m]["hook_bound_ratio"] for m in ("loglikelihood", "generate_until"))
            for p in inf["points"]
        )
        out.append(
            f"Inference: timed inside the real lm-eval calls, the two surgery hooks take at most "
            f"{(1 - worst) * 100:.2f} % of hf-darts' time (last column): the overhead the "
            f"end-to-end ratios measure, give or take their run-to-run spread (quartiles)."
        )
    return out


def _entropy_chunk() -> int:
    """Positions per entropy call in capture (whole rows before that constant existed)."""
    from mergekit_darts.calibrate import capture

    return getattr(capture, "ENTROPY_CHUNK", 512)


def _entropy_line(e: dict[str, Any]) -> str:
    return (
        f"V = {e['vocab']}: the target capture with entropy grows memory by "
        f"{_size(e['capture_with_entropy_growth'])}, the same capture without entropy by "
        f"{_size(e['capture_hidden_only_growth'])}: "
        f"entropy costs {_size(e['entropy_extra_bytes'])} "
        f"(one batch of logits is {_size(e['one_batch_logits_bytes'])}), against "
        f"{_size(e['ntv_float32_bytes'])} for the N x T x V float32 logits tensor it never builds."
    )


def plot_scaling(sc: dict[str, Any], path: Path) -> Path:
    """Four panels, one per axis: precompute, training and their sum against the axis value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_names = list(dict.fromkeys(r["axis"] for r in sc["rows"]))
    fig, axes = plt.subplots(1, len(axes_names), figsize=(4 * len(axes_names), 3.4), squeeze=False)
    for ax, name in zip(axes[0], axes_names, strict=True):
        rows = sorted((r for r in sc["rows"] if r["axis"] == name), key=lambda r: r["value"])
        xs = [r["value"] for r in rows]
        for key, label in (
            ("precompute_s", "precompute"),
            ("train_s", f"train {sc['steps']} steps"),
            ("total_s", "sum"),
        ):
            ax.plot(xs, [r[key] for r in rows], marker="o", label=label)
        ax.set_xlabel(name)
        ax.set_ylabel("seconds")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # equal slopes = equal scaling exponents
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("DARTS calibration cost vs N, prompt length T, rank and hidden size H")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(results: dict[str, Any], folder: str | Path) -> dict[str, str]:
    """``bench.json``, ``bench.md`` and ``scaling.png`` under ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = {"json": str(folder / "bench.json"), "markdown": str(folder / "bench.md")}
    Path(written["json"]).write_text(json.dumps(results, indent=1, default=str) + "\n")
    Path(written["markdown"]).write_text(markdown(results))
    if "scaling" in results:
        written["plot"] = str(plot_scaling(results["scaling"], folder / "scaling.png"))
    return written
