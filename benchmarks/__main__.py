"""``python -m benchmarks`` (``make bench``): measure, print the markdown report, save JSON + PNG.

Defaults fit a 2-core CPU in about five minutes. At 7B scale on a GPU, for example::

    python -m benchmarks --device cuda --dtype bfloat16 --hidden 4096 --layers 32 \\
        --max-length 512 --inference-hidden 4096 --scale-hidden 2048,4096
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.fixtures import ModelSpec, from_options
from benchmarks.settings import DEFAULT_STARTUP, SECTIONS, BenchSettings


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str] | None = None) -> BenchSettings:
    d = BenchSettings()
    m = d.model
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    g = p.add_argument_group("model (random Llama built locally)")
    g.add_argument("--hidden", type=int, default=m.hidden)
    g.add_argument("--layers", type=int, default=m.layers)
    g.add_argument("--vocab", type=int, default=m.vocab)
    g.add_argument("--intermediate", type=int, default=None)
    g.add_argument("--heads", type=int, default=None)
    g.add_argument("--dtype", default=m.dtype, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--merged", help="a real merged checkpoint folder instead of a random model")
    g.add_argument("--target", help="its target fine-tune (with --merged)")
    g = p.add_argument_group("calibration")
    g.add_argument("--device", default=d.device, help="cpu, cuda, cuda:1 or auto")
    g.add_argument("--n", type=int, default=d.n, help="calibration prompts")
    g.add_argument("--max-length", type=int, default=d.max_length, help="longest prompt, tokens")
    g.add_argument("--max-positions", type=int, default=d.max_positions)
    g.add_argument("--rank", type=int, default=d.rank)
    g.add_argument("--steps", type=int, default=d.steps)
    g.add_argument("--batch-size", type=int, default=d.batch_size)
    g.add_argument("--repeats", type=int, default=d.repeats, help="interleaved rounds per ratio")
    g.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="torch threads: -1 = 1 on CPU, 0 = torch default",
    )
    g = p.add_argument_group("inference and startup")
    g.add_argument("--inference-hidden", type=_ints, default=d.inference_hidden)
    g.add_argument("--inference-repeats", type=int, default=d.inference_repeats)
    g.add_argument("--ll-requests", type=int, default=d.ll_requests)
    g.add_argument("--gen-tokens", type=int, default=d.gen_tokens)
    g.add_argument(
        "--startup-repeats", type=_ints, default=None, help="pairs per command, e.g. 2,10"
    )
    g = p.add_argument_group("scaling")
    g.add_argument("--scale-n", type=_ints, default=d.scale_n)
    g.add_argument("--scale-t", type=_ints, default=d.scale_t)
    g.add_argument("--scale-rank", type=_ints, default=d.scale_rank)
    g.add_argument("--scale-hidden", type=_ints, default=d.scale_hidden)
    g.add_argument("--scale-steps", type=int, default=d.scale_steps)
    g = p.add_argument_group("output")
    g.add_argument("--sections", default=",".join(SECTIONS), help=",".join(SECTIONS))
    g.add_argument("--results", default=d.results)
    g.add_argument("--workdir", help="keep the built models here (default: a temporary folder)")
    g.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    sections = tuple(s.strip() for s in a.sections.split(",") if s.strip())
    if unknown := set(sections) - set(SECTIONS):
        p.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    if bool(a.merged) != bool(a.target):
        p.error("--merged and --target go together")
    startup = dict(DEFAULT_STARTUP)
    if a.startup_repeats:
        startup = {
            k: (v[0], r) for (k, v), r in zip(startup.items(), a.startup_repeats, strict=False)
        }
    device = a.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return from_options(
        BenchSettings,
        a,
        model=from_options(ModelSpec, a),
        device=device,
        startup=startup,
        sections=sections,
        progress=not a.no_progress,
    )


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from benchmarks import report
    from benchmarks.runner import count_steps, run_all

    columns = (TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not settings.progress, transient=True) as progress:
        task = progress.add_task("benchmarks", total=count_steps(settings))
        first = [True]

        def tick(label: str) -> None:
            if not first[0]:
                progress.advance(task)
            first[0] = False
            progress.update(task, description=label)

        results = run_all(settings, tick)
    written = report.write(results, settings.results)
    sys.stdout.write(report.markdown(results))
    sys.stdout.write("\nWritten: " + ", ".join(written.values()) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
