"""The exports under vLLM tensor parallelism (``tensor_parallel_size=2``) on the CPU build.

Each rank runs its own copy of the model: the plugin must be loaded in each worker process, and
each rank must correct its own copy of the final hidden state (replicated across ranks after the
final norm) before its shard of the vocabulary-parallel LM head. The checks:

- the same batches as the one-process engine tests (``check_batch``, ``check_prefix_cache``:
  continuous batching, chunked prefill, prefix caching), full-vocabulary log-probs within
  ``TOL`` of the float64 reference and greedy tokens equal to its argmax, the same assertions
  the ``tensor_parallel_size=1`` tests make on the same prompts, so the greedy tokens of both
  engines are equal;
- for each rank, the log-probs a rank that skipped its correction would give (its vocabulary
  shard's logits uncorrected, the other shards corrected) are far outside ``TOL``: so passing the
  first check means every rank corrected;
- ``vllm serve --tensor-parallel-size 2`` (the AsyncLLM path), queried over the loopback
  address: top-20 log-probs and greedy tokens against the reference.

vLLM's CPU build binds each rank's OpenMP threads to CPU cores; its automatic binding wants one
NUMA node per rank, so the tests give the ranks the allowed cores themselves
(``VLLM_CPU_OMP_THREADS_BIND``). One engine per export, one ``vllm serve``.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import Exported, float64_reference, post, routed_float64_reference, served
from test_vllm_plugin import TOL, check_batch, check_prefix_cache, prompt, start_engine

TP = 2
TOP = 20  # vLLM's default max_logprobs: what a served request may ask for


def rank_cpus(world_size: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``world_size`` ranks: the allowed cores split in order
    (ranks share a core when there are fewer cores than ranks)."""
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = max(1, len(cpus) // world_size)
    lists = [cpus[(r * per_rank) % len(cpus) :][:per_rank] for r in range(world_size)]
    return "|".join(",".join(map(str, cores)) for cores in lists)


def vocab_shards(vocab_size: int, world_size: int) -> list[range]:
    """The token ids each rank's shard of vLLM's vocabulary-parallel LM head computes."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        pad_vocab_size,
        vocab_range_from_global_vocab_size,
    )

    padded = pad_vocab_size(vocab_size)
    shards = []
    for rank in range(world_size):
        start, end = vocab_range_from_global_vocab_size(padded, rank, world_size)
        shards.append(range(min(start, vocab_size), min(end, vocab_size)))
    assert all(shards), f"a rank holds no token of the {vocab_size}: the check would be empty"
    return shards


def check_every_rank_corrects(reference, ids: list[int], vocab_size: int) -> None:
    """A rank that skipped the correction would leave its shard's logits uncorrected: for each
    rank, those log-probs must be far from the corrected reference (so within ``TOL`` means
    every rank corrected)."""
    corrected = reference(ids, logits=True)
    plain = reference(ids, surgery=False, logits=True)
    want = torch.log_softmax(corrected, dim=-1)
    for rank, shard in enumerate(vocab_shards(vocab_size, TP)):
        skipped = corrected.clone()
        skipped[:, shard] = plain[:, shard]
        gap = float((torch.log_softmax(skipped, dim=-1) - want).abs().max())
        assert gap > 100 * TOL, f"rank {rank}'s correction would not show ({gap:.1e})"


@pytest.fixture
def ranks_bound(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", rank_cpus(TP))
    return os.environ["VLLM_CPU_OMP_THREADS_BIND"]


def serve_and_check(exported: Exported, reference, ranks: str) -> float:
    """Run one engine at ``tensor_parallel_size=2`` through the batch and prefix-cache checks and
    the every-rank check; returns the largest log-prob error."""
    llm = start_engine(exported, tensor_parallel_size=TP)
    try:
        batch = check_batch(llm, exported.vocab_size, reference)
        cached = check_prefix_cache(llm, exported.vocab_size, reference)
        ids = llm.get_tokenizer()(prompt(40, offset=5))["input_ids"]
    finally:
        del llm
    check_every_rank_corrects(reference, ids, exported.vocab_size)
    print(
        f"TP={TP} (cores {ranks}): largest log-prob error vs the float64 reference: {batch:.2e} "
        f"(batch), {cached:.2e} (prefix cache)"
    )
    return max(batch, cached)


def test_single_task_export_under_tensor_parallel(
    exported: Exported, reference, ranks_bound: str
) -> None:
    assert serve_and_check(exported, reference, ranks_bound) < TOL


def test_routed_export_under_tensor_parallel(routed_exported, ranks_bound: str) -> None:
    exported = routed_exported["routed"]
    reference = routed_float64_reference(exported)
    assert serve_and_check(exported, reference, ranks_bound) < TOL


def test_vllm_serve_under_tensor_parallel(exported: Exported, tokenizer, ranks_bound: str) -> None:
    """``vllm serve --tensor-parallel-size 2``: greedy tokens and top-20 log-probs over HTTP."""
    reference = float64_reference(exported)
    texts = [prompt(n, offset=n) for n in (5, 30, 50)]
    with served(exported.dest, "--tensor-parallel-size", str(TP)) as url:
        answers = post(
            f"{url}/v1/completions",
            {
                "model": str(exported.dest),
                "prompt": texts,
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": TOP,
                "ignore_eos": True,
                "return_tokens_as_token_ids": True,
            },
        )["choices"]
    assert sorted(a["index"] for a in answers) == list(range(len(texts)))
    errors = []
    for answer in answers:
        ids = tokenizer(texts[answer["index"]])["input_ids"]
        logprobs = answer["logprobs"]
        generated = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
        ref = reference(ids + generated)[len(ids) - 1 : -1]
        assert generated == ref.argmax(-1).tolist()
        for row, top in zip(ref, logprobs["top_logprobs"], strict=True):
            tokens = torch.tensor([int(t.removeprefix("token_id:")) for t in top])
            got = torch.tensor(list(top.values()), dtype=torch.float64)
            assert len(tokens) == TOP and got.min() >= row.topk(TOP).values[-1] - TOL  # the top 20
            errors.append(float((got - row[tokens]).abs().max()))
    longest = tokenizer(texts[-1])["input_ids"]
    check_every_rank_corrects(reference, longest, exported.vocab_size)
    print(f"vllm serve TP={TP}: largest top-{TOP} log-prob error vs float64: {max(errors):.2e}")
    assert max(errors) < TOL
