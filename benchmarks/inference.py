"""Inference overhead of the surgery: ``hf-darts`` vs ``hf`` through lm-eval's own classes.

Both classes load the same merged folder; requests are built as lm-eval builds them
(:class:`lm_eval.api.instance.Instance`) and go through ``loglikelihood`` and
``generate_until``. The module is a pos_corr module with random, non-zero weights, so every
correction is really computed. The raw ``apply_surgery`` hooks are timed on the bare model too,
which separates the hooks' own cost from lm-eval's.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.calibration import ratio
from benchmarks.fixtures import build_pair, random_texts
from benchmarks.measure import alternate, clock, cuda_sync, paired_ratio

TASK = "bench"


def write_random_surgery(
    folder: Path, hidden: int, vocab: int, rank: int, max_positions: int, calibration: int = 50
) -> Path:
    """A surgery folder holding one pos_corr module whose correction is not zero.

    Its diagnostics hold ``calibration`` random sequences of ``max_positions`` tokens, so
    ``hf-darts`` runs its calibration-leakage check on every call, as after a real surgery.
    """
    import torch

    from mergekit_darts import build_module
    from mergekit_darts.folder.artifacts import write_surgery_folder
    from mergekit_darts.folder.diagnostics import diagnostics_bytes
    from mergekit_darts.folder.manifest import diagnostics_file

    module = build_module("pos_corr", hidden, rank, max_positions, seed=0)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        module.up.weight.normal_(0, 0.02)
        module.position_bias.normal_(0, 0.02)
        ids = torch.randint(vocab, (calibration, max_positions))
    diagnostics = diagnostics_file(TASK)
    entry = {
        "module": "pos_corr",
        "rank": rank,
        "max_positions": max_positions,
        "diagnostics": diagnostics,
    }
    manifest = {"hidden_size": hidden, "vocab_size": vocab, "tasks": {TASK: entry}}
    real = torch.ones_like(ids, dtype=torch.bool)
    zero = torch.zeros(ids.shape, dtype=torch.float32)  # no bias measured: only the ids are read
    extra = {diagnostics: diagnostics_bytes(ids.tolist(), real, real, zero, zero)}
    return write_surgery_folder(folder, {TASK: module}, manifest, extra_files=extra)


def _requests(tokenizer: Any, settings: Any) -> tuple[list[Any], list[Any], int]:
    """Loglikelihood and generate_until instances, and the loglikelihood token count."""
    from lm_eval.api.instance import Instance

    ctx = random_texts(tokenizer, settings.ll_requests, settings.ll_context, settings.ll_context, 1)
    cont = random_texts(tokenizer, settings.ll_requests, 1, 4, 2)
    ll = [
        Instance("loglikelihood", {}, (c, " " + x), i, (TASK, i, 1))
        for i, (c, x) in enumerate(zip(ctx, cont, strict=True))
    ]
    tokens = sum(len(tokenizer(c + " " + x)["input_ids"]) for c, x in zip(ctx, cont, strict=True))
    prompts = random_texts(tokenizer, settings.gen_requests, 16, 32, 3)
    gen_kwargs = {"until": ["@@never@@"], "max_gen_toks": settings.gen_tokens, "do_sample": False}
    gen = [
        Instance("generate_until", {}, (p, dict(gen_kwargs)), i, (TASK, i, 1))
        for i, p in enumerate(prompts)
    ]
    return ll, gen, tokens


def _generated_tokens(tokenizer: Any, outputs: list[str]) -> int:
    return sum(len(tokenizer(o, add_special_tokens=False)["input_ids"]) for o in outputs)


def _throughput(
    hf: Any,
    darts: Any,
    method: str,
    requests: list[Any],
    count: Callable[[list[Any]], int],
    reps: int,
    hooks: HookTimer,
) -> dict[str, Any]:
    """tokens/s of each class over interleaved rounds, and the hooks' share of hf-darts' time."""
    outputs: dict[str, list[Any]] = {}

    def call(name: str, lm: Any) -> Callable[[], None]:
        def go() -> None:
            outputs[name] = getattr(lm, method)(requests, disable_tqdm=True)

        return go

    sync = cuda_sync(str(hf.device))
    call("hf", hf)()  # warm-up
    call("hf-darts", darts)()
    hooks.reset()
    times = alternate({"hf": call("hf", hf), "hf-darts": call("hf-darts", darts)}, reps, sync)
    hook_share = hooks.seconds / sum(times["hf-darts"])
    paired = paired_ratio(times, "hf", "hf-darts")  # time ratio = throughput ratio per token
    hf_tokens, darts_tokens = count(outputs["hf"]), count(outputs["hf-darts"])
    return {
        "hf_tok_s": hf_tokens / paired["hf_s"],
        "darts_tok_s": darts_tokens / paired["hf-darts_s"],
        "ratio": paired["ratio"] * darts_tokens / hf_tokens,
        "ratio_q1": paired["ratio_q1"] * darts_tokens / hf_tokens,
        "ratio_q3": paired["ratio_q3"] * darts_tokens / hf_tokens,
        "ratio_of_fastest": paired["ratio_of_fastest"] * darts_tokens / hf_tokens,
        "hf_rounds_s": paired["hf_rounds_s"],
        "darts_rounds_s": paired["hf-darts_rounds_s"],
        "darts_s": paired["hf-darts_s"],
        "hook_share": hook_share,
        "hook_bound_ratio": 1 - hook_share,
        "hook_us_per_call": hooks.seconds / max(hooks.calls, 1) * 3e6,  # three hooks per call
    }


class HookTimer:
    """Time spent inside the surgery hooks of handles created while this context is open.

    The wrappers go on the :class:`~mergekit_darts.apply.SurgeryHandle` class, so the bound
    methods a handle registers as hooks at creation are the timed ones; the class is put back on
    exit while those hooks keep timing. Timing the hooks inside real calls counts what they cost
    there, cold caches included: called in a tight loop instead, they looked 4x cheaper.
    """

    NAMES = ("_enter", "_leave", "_correct")  # the three hooks of one forward call

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._saved: dict[str, Any] = {}

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        timer = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            now = clock()
            started = now()
            try:
                return fn(*args, **kwargs)
            finally:
                timer.seconds += now() - started
                timer.calls += 1

        return timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def __enter__(self) -> HookTimer:
        from mergekit_darts.apply import SurgeryHandle

        for name in self.NAMES:
            self._saved[name] = getattr(SurgeryHandle, name)
            setattr(SurgeryHandle, name, self._wrap(self._saved[name]))
        return self

    def __exit__(self, *_exc: object) -> None:
        from mergekit_darts.apply import SurgeryHandle

        for name, fn in self._saved.items():
            setattr(SurgeryHandle, name, fn)


def raw_overhead(model: Any, module: Any, tokenizer: Any, settings: Any) -> dict[str, float]:
    """Forward and generate on the bare HF model, with and without ``apply_surgery``'s hooks."""
    import torch

    from mergekit_darts import apply_surgery

    device = next(model.parameters()).device
    texts = random_texts(
        tokenizer, settings.batch_size, settings.ll_context, settings.ll_context, 4
    )
    batch = tokenizer(texts, return_tensors="pt", padding=True).to(device)
    prompt = tokenizer(texts[:1], return_tensors="pt").to(device)

    def forward() -> None:
        with torch.no_grad():
            model(**batch, use_cache=False)

    def generate() -> None:
        model.generate(
            **prompt, max_new_tokens=settings.gen_tokens, do_sample=False, pad_token_id=0
        )

    def plain(fn: Callable[[], None]) -> Callable[[], None]:
        return fn

    def with_surgery(fn: Callable[[], None]) -> Callable[[], None]:
        def go() -> None:
            with apply_surgery(model, module):
                fn()

        return go

    sync = cuda_sync(str(device))
    out = {}
    for name, fn in (("forward", forward), ("generate", generate)):
        fn()
        times = alternate(
            {"plain": plain(fn), "surgery": with_surgery(fn)}, settings.inference_repeats, sync
        )
        out[f"raw_{name}_ratio"] = paired_ratio(times, "plain", "surgery")["ratio"]
    return out


def measure_point(merged: str, surgery: Path, settings: Any) -> dict[str, Any]:
    """One hidden size: loglikelihood and generate_until tokens/s of hf and hf-darts."""
    from lm_eval.models.huggingface import HFLM

    from lm_eval_darts.model import DartsHFLM
    from mergekit_darts import load_surgery

    common = dict(
        device=settings.device,
        dtype=settings.model.dtype,
        batch_size=settings.batch_size,
    )
    hf = HFLM(pretrained=merged, **common)
    with HookTimer() as hooks:
        darts = DartsHFLM(pretrained=merged, surgery=TASK, surgery_path=str(surgery), **common)
    tokenizer = hf.tokenizer
    ll, gen, ll_tokens = _requests(tokenizer, settings)
    reps = settings.inference_repeats
    result = {
        "loglikelihood": _throughput(
            hf, darts, "loglikelihood", ll, lambda _: ll_tokens, reps, hooks
        ),
        "generate_until": _throughput(
            hf,
            darts,
            "generate_until",
            gen,
            lambda o: _generated_tokens(tokenizer, o),
            reps,
            hooks,
        ),
        "loglikelihood_tokens": ll_tokens,
    }
    result |= raw_overhead(hf.model, load_surgery(surgery, TASK), tokenizer, settings)
    del hf, darts
    gc.collect()
    return result


def run(settings: Any, root: Path, tick: Callable[[str], None]) -> dict[str, Any]:
    """Every hidden size in ``settings.inference_hidden``; the 0.97 target applies from H = 512."""
    from benchmarks.settings import with_model

    points = []
    ratios: dict[str, Any] = {}
    for hidden in settings.inference_hidden:
        tick(f"inference: hf vs hf-darts, H={hidden}")
        spec = with_model(settings, hidden=hidden).model
        pair = build_pair(root, spec)
        surgery = write_random_surgery(
            root / f"surgery-{spec.tag()}",
            hidden,
            spec.vocab,
            settings.rank,
            settings.max_positions,
        )
        point = {"hidden": hidden, **measure_point(pair.merged, surgery, settings)}
        points.append(point)
        target = 0.97 if hidden >= 512 else None
        for method in ("loglikelihood", "generate_until"):
            ratios[f"hf-darts / hf tokens/s, {method}, H={hidden}"] = ratio(
                point[method]["ratio"], target, better="higher"
            )
    return {"points": points, "ratios": ratios}
