"""A ``--routed`` export and a ``none`` export in vLLM (``LLM(model=DEST)``), against float64.

The routed export holds every task's module and the router: vLLM's model forward corrects each
token from its own final hidden state and the absolute position vLLM passes, so the same checks as
for a single module hold (continuous batching, chunked prefill, prefix caching) against
h - sum_k g_k(h) (c_k(h) + b_k[p]) computed in float64 here. The ``none`` export is the plain
merge. One engine each; ``vllm serve`` of the routed export is in ``test_vllm_cli.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import HIDDEN, MAX_POSITIONS, RANK, ROUTED_KINDS, routed_float64_reference
from test_vllm_plugin import (
    TOL,
    check_batch,
    check_prefix_cache,
    check_request,
    prompt,
    start_engine,
)

from mergekit_darts.correction.darts_correction import RoutedSurgery, correction_module


def test_the_routed_export(routed_exported) -> None:
    exported = routed_exported["routed"]
    assert isinstance(exported.module, RoutedSurgery)
    reference = routed_float64_reference(exported)
    llm = start_engine(exported)
    try:
        batch = check_batch(llm, exported.vocab_size, reference)
        cached = check_prefix_cache(llm, exported.vocab_size, reference)
    finally:
        del llm
    print(
        f"routed: largest log-prob error vs the float64 reference: {batch:.2e} (batch), "
        f"{cached:.2e} (prefix cache)"
    )
    assert batch < TOL and cached < TOL


def test_the_none_export_is_the_plain_merge(routed_exported) -> None:
    from vllm import SamplingParams

    exported = routed_exported["none"]
    routed = routed_float64_reference(routed_exported["routed"])

    def plain(ids: list[int], surgery: bool = True) -> torch.Tensor:
        return routed(ids, surgery=False)

    llm = start_engine(exported)
    try:
        v = exported.vocab_size
        params = SamplingParams(
            temperature=0, max_tokens=8, logprobs=v, prompt_logprobs=v, ignore_eos=True
        )
        prompts = [prompt(n, offset=n) for n in (3, 20, 60)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        error = max(check_request(o, plain, v) for o in outputs)
    finally:
        del llm
    print(f"none: largest log-prob error vs the plain float64 merge: {error:.2e}")
    assert error < TOL


def test_routed_and_none_surgery_tensors_load_and_are_checked() -> None:
    """``load_weights``' check on the real class, without an engine start."""
    from types import SimpleNamespace

    from tiny import random_module, random_router

    from mergekit_darts.correction.darts_correction import RoutedSurgery
    from mergekit_darts.hosts.vllm_plugin.model import SURGERY, vllm_model_class

    cls = vllm_model_class("LlamaForCausalLM")
    tasks = [
        {"name": n, "module": k, "rank": RANK, "max_positions": MAX_POSITIONS}
        for n, k in ROUTED_KINDS.items()
    ]
    model = SimpleNamespace()
    setattr(model, SURGERY, RoutedSurgery.zeros(tasks, True, HIDDEN))
    modules = {
        n: random_module(k, HIDDEN, RANK, MAX_POSITIONS, seed=i)
        for i, (n, k) in enumerate(ROUTED_KINDS.items())
    }
    router = random_router(HIDDEN, list(ROUTED_KINDS), True, seed=1)
    state = RoutedSurgery(modules, router).state_dict()
    assert cls._load_surgery(model, state) == {f"{SURGERY}.{k}" for k in state}
    h, p = torch.randn(5, HIDDEN), torch.arange(5)
    want = RoutedSurgery(modules, router)(h, p)
    torch.testing.assert_close(getattr(model, SURGERY)(h, p), want, rtol=0, atol=1e-6)
    without_router = {k: v for k, v in state.items() if not k.startswith("router.")}
    with pytest.raises(ValueError, match="do not match the routed module"):
        cls._load_surgery(model, without_router)
    setattr(model, SURGERY, correction_module("none", HIDDEN, RANK, MAX_POSITIONS))
    assert cls._load_surgery(model, {}) == set()
    assert getattr(model, SURGERY)(h, p) is h
    with pytest.raises(ValueError, match="do not match the none module"):
        cls._load_surgery(model, {"down.weight": torch.zeros(RANK, HIDDEN)})
