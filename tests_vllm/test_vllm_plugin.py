"""The exported folder in vLLM (``LLM(model=DEST)``) against an independent float64 reference.

vLLM corrects the hidden states its model's forward returns, with the absolute positions vLLM
hands that forward. These tests put that under continuous batching (prompts of different lengths
in one batch), chunked prefill (prompts longer than ``max_num_batched_tokens``) and prefix caching
(a second request whose first blocks come from the cache), and compare full-vocabulary log-probs of
prompt and generated positions, and greedy tokens, with h - c(h) - b_p computed here in float64.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ENGINE, HIDDEN, RANK, Exported, copy_export, random_module

TOL = 1e-5
WORDS = "the sun and the moon one two three four five six seven if x is not y then print".split()


def prompt(n: int, offset: int = 0) -> str:
    return " ".join(WORDS[(i + offset) % len(WORDS)] for i in range(n))


def start_engine(exported: Exported, **overrides: Any):
    """An engine with chunked prefill and prefix caching on, in small chunks (``overrides``: more
    engine arguments, e.g. ``tensor_parallel_size``)."""
    from vllm import LLM

    return LLM(
        model=str(exported.dest),
        max_logprobs=exported.vocab_size,  # full-vocabulary log-probs
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,  # a prompt longer than this is prefilled in chunks
        **ENGINE | overrides,
    )


@pytest.fixture(scope="module")
def llm(exported: Exported):
    """One engine for every in-process check of the Llama export."""
    engine = start_engine(exported)
    yield engine
    del engine


def as_matrix(rows: list[dict], vocab_size: int) -> torch.Tensor:
    """vLLM's per-position {token: Logprob} dicts -> [T, V] float64 (every token must be there)."""
    out = torch.full((len(rows), vocab_size), math.nan, dtype=torch.float64)
    for i, row in enumerate(rows):
        for token, logprob in row.items():
            out[i, token] = logprob.logprob
    assert not out.isnan().any(), "vLLM left out tokens: max_logprobs must be the vocabulary size"
    return out


def check_request(output, reference, vocab_size: int, prompt_logprobs: bool = True) -> float:
    """Compare one finished request with the reference; returns the largest log-prob error."""
    prompt_ids = list(output.prompt_token_ids)
    generated = output.outputs[0]
    ids = prompt_ids + list(generated.token_ids)
    ref = reference(ids)
    n = len(prompt_ids)
    # greedy: each generated token is the reference's argmax given everything before it
    assert list(generated.token_ids) == ref[n - 1 : len(ids) - 1].argmax(-1).tolist()
    errors = [(as_matrix(generated.logprobs, vocab_size) - ref[n - 1 : len(ids) - 1]).abs().max()]
    if prompt_logprobs:
        assert output.prompt_logprobs[0] is None  # nothing predicts the first token
        got = as_matrix(output.prompt_logprobs[1:], vocab_size)
        errors.append((got - ref[: n - 1]).abs().max())
    return max(float(e) for e in errors)


def check_batch(llm, vocab_size: int, reference) -> float:
    """One batch of prompts of 3 to 60 tokens; returns the largest log-prob error."""
    from vllm import SamplingParams

    v = vocab_size
    params = SamplingParams(
        temperature=0, max_tokens=12, logprobs=v, prompt_logprobs=v, ignore_eos=True
    )
    # lengths 3..60: one batch mixes short prompts with ones prefilled in 32-token chunks, and
    # generation runs past max_positions (48), where the position term stops
    prompts = [prompt(n, offset=n) for n in (3, 9, 20, 40, 60)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    error = max(check_request(o, reference, v) for o in outputs)
    # and the surgery is visible: without it the log-probs are far off
    plain = reference(list(outputs[2].prompt_token_ids), surgery=False)
    assert (plain - reference(list(outputs[2].prompt_token_ids))).abs().max() > 1e-2
    return error


def check_prefix_cache(llm, vocab_size: int, reference) -> float:
    """Requests whose first 32-token block comes from the prefix cache; the largest error."""
    from vllm import SamplingParams

    v = vocab_size
    shared = prompt(40, offset=3)  # > one 32-token block, so its first block is cached
    first = llm.generate(
        [shared + " one"], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False
    )[0]
    assert first.outputs[0].token_ids
    # prompt log-probs would make vLLM skip the prefix cache: ask for generated ones only
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=v, ignore_eos=True)
    outputs = llm.generate([shared + " two three", shared + " if x"], params, use_tqdm=False)
    for output in outputs:
        assert output.num_cached_tokens >= 32, "the shared prefix was not served from the cache"
    return max(check_request(o, reference, v, prompt_logprobs=False) for o in outputs)


def test_logprobs_and_greedy_tokens_match_under_batching_and_chunked_prefill(
    llm, exported: Exported, reference
) -> None:
    error = check_batch(llm, exported.vocab_size, reference)
    print(f"largest log-prob error vs the float64 reference: {error:.2e}")
    assert error < TOL


def test_prefix_cached_requests_keep_absolute_positions(llm, exported: Exported, reference) -> None:
    error = check_prefix_cache(llm, exported.vocab_size, reference)
    print(f"largest log-prob error vs the float64 reference (prefix cache): {error:.2e}")
    assert error < TOL


def refusal(dest: Path) -> list[str]:
    """The messages of the error ``LLM(model=dest)`` raises, and of its causes."""
    from vllm import LLM

    with pytest.raises(Exception) as info:
        LLM(model=str(dest), **ENGINE)
    chain, err = [], info.value
    while err is not None:
        chain.append(str(err))
        err = err.__cause__ or err.__context__
    return chain


def test_a_broken_darts_section_is_refused_before_loading(
    exported: Exported, tmp_path: Path
) -> None:
    dest = copy_export(exported, tmp_path / "dest")
    config = json.loads((dest / "config.json").read_text())
    config["darts"]["version"] = 99
    (dest / "config.json").write_text(json.dumps(config))
    chain = refusal(dest)
    assert any("version 99" in message and "mergekit-darts" in message for message in chain), chain


def test_a_surgery_file_swapped_in_from_another_export_is_refused(
    exported: Exported, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The export binds its surgery file (config.json's darts.weights): another module's
    tensors of the same shapes would otherwise be served as this task's correction. The check
    runs where the model is built (a worker process: what it logs, on stdout or stderr, is read
    too)."""
    from safetensors.torch import save_file

    from mergekit_darts.correction.modeling_darts import SURGERY_FILE, TENSOR_PREFIX

    dest = copy_export(exported, tmp_path / "dest")
    other = {TENSOR_PREFIX + k: v for k, v in random_module(seed=9).state_dict().items()}
    save_file(other, dest / SURGERY_FILE, metadata={"format": "pt"})
    chain = refusal(dest)
    logged = capfd.readouterr()
    messages = [*chain, logged.out, logged.err]
    assert any("is not the surgery file this DARTS export" in m for m in messages), chain


def test_surgery_tensors_that_do_not_fit_the_config_are_refused() -> None:
    """The check inside load_weights, on the real class, without an engine start."""
    from types import SimpleNamespace

    from mergekit_darts.hosts.vllm_plugin.model import SURGERY, vllm_model_class

    cls = vllm_model_class("LlamaForCausalLM")
    model = SimpleNamespace()
    setattr(model, SURGERY, random_module(seed=3))
    wrong_rank = {k: v for k, v in random_module(seed=3).state_dict().items()}
    wrong_rank["down.weight"] = torch.zeros(RANK + 1, HIDDEN)
    for tensors in (wrong_rank, {}):
        with pytest.raises(ValueError, match="do not match the pos_corr module"):
            cls._load_surgery(model, tensors)
    fitting = random_module(seed=4).state_dict()
    assert cls._load_surgery(model, fitting) == {f"{SURGERY}.{k}" for k in fitting}
    assert torch.equal(getattr(model, SURGERY).position_bias, fitting["position_bias"])


IMPORTS = """
import json, sys
import vllm
from vllm import ModelRegistry
from vllm.sequence import IntermediateTensors
before = set(sys.modules)
import mergekit_darts.hosts.vllm_plugin.model
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_the_model_module_loads_nothing_but_the_shipped_files() -> None:
    """Beyond vLLM's own imports: no CLI, calibration or lm-eval libraries in vLLM's workers."""
    out = subprocess.run(
        [sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True
    )
    assert set(json.loads(out.stdout.splitlines()[-1])) == {
        "mergekit_darts",
        "mergekit_darts.correction",
        "mergekit_darts.correction.darts_correction",  # the shipped files
        "mergekit_darts.correction.modeling_darts",
        "mergekit_darts.errors",  # the error classes alone: it imports nothing
        "mergekit_darts.hosts",
        "mergekit_darts.hosts.vllm_plugin",
        "mergekit_darts.hosts.vllm_plugin.model",
    }
