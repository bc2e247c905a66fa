"""Training with the pad rows skipped (demo.packed) is plain training: the same numbers, and under
the demo's pins the same bits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from demo.family_io import collate
from demo.packed import skip_padding
from demo.pinning import pinned_env

PAD = 0


def _model(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=20,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        pad_token_id=PAD,
    )
    return LlamaForCausalLM(config).to(dtype)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded sequences of different lengths; one holds the pad id before its end (a real
    token there, not padding) and one has its loss on the last two tokens only."""
    seqs = [
        ([3, 4, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9]),
        ([5, 6], [5, 6]),
        ([7, PAD, 9, 10], [7, PAD, 9, 10]),
        ([11, 12, 13, 14, 15], [-100, -100, -100, 14, 15]),
    ]
    return collate(seqs, PAD)


def _loss_and_grads(
    model: LlamaForCausalLM, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=batch[0], labels=batch[1]).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_skipping_the_pad_rows_changes_neither_loss_nor_gradients() -> None:
    model, batch = _model(torch.float64), _batch()
    plain_loss, plain = _loss_and_grads(model, batch)
    with skip_padding(model, PAD):
        loss, grads = _loss_and_grads(model, batch)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-12, atol=1e-12)
    assert grads.keys() == plain.keys()
    assert not any(g.requires_grad for g in grads.values())  # plain tensors, as autograd's
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[name], rtol=1e-10, atol=1e-12, msg=name)


def test_the_real_positions_see_the_same_logits_and_the_model_is_restored() -> None:
    model, (input_ids, _) = _model(torch.float64), _batch()
    plain = model(input_ids=input_ids).logits
    with skip_padding(model, PAD):
        logits = model(input_ids=input_ids).logits
    real = torch.zeros_like(input_ids, dtype=torch.bool)
    for row, length in enumerate([7, 2, 4, 5]):
        real[row, :length] = True
    torch.testing.assert_close(logits[real], plain[real], rtol=1e-12, atol=1e-12)
    assert (logits[~real] == 0).all()  # pad rows: nothing multiplied
    assert torch.equal(model(input_ids=input_ids).logits, plain)  # plain linear layers again


# A few steps of the full-scale base and of an expert, once plainly and once with the pad rows
# skipped, in a process under the demo's pins (which act only when set before torch starts).
IDENTITY = """
import random
from contextlib import nullcontext

import torch
from safetensors.torch import load_file

from demo import family
from demo.domains import DOMAIN_NAMES, make_splits
from demo.family_io import build_environment
from demo.pinning import apply_in_process

apply_in_process()
recipe = family.SCALES["full"]
tokenizer = family.build_tokenizer()
held_out = {d: make_splits(d, 0, n_eval=recipe.n_eval).held_out() for d in DOMAIN_NAMES}


def train(base_state=None):
    torch.manual_seed(0)
    model = family.LlamaForCausalLM(family._model_config(recipe, tokenizer))
    if base_state is None:
        rng, lr = random.Random("darts-demo:0:base"), recipe.base_lr
        batches = family._base_batches(rng, tokenizer, recipe, held_out)
    else:
        model.load_state_dict(base_state)
        rng, lr = random.Random("darts-demo:0:math"), recipe.expert_lr
        batches = family._expert_batches(rng, tokenizer, recipe, "math", held_out["math"])
    with build_environment(False):
        loss = family._train(model, batches, 3, lr, recipe, False)
    return loss, {k: v.clone() for k, v in model.state_dict().items()}


packed_base = train()
packed_expert = train(packed_base[1])
family.skip_padding = lambda model, pad_id: nullcontext()
plain_base = train()
plain_expert = train(plain_base[1])
for packed, plain in [(packed_base, plain_base), (packed_expert, plain_expert)]:
    assert packed[0] == plain[0], (packed[0], plain[0])
    unequal = [k for k, v in plain[1].items() if not torch.equal(packed[1][k], v)]
    assert not unequal, unequal
print("bit-identical")
"""


@pytest.mark.slow  # trains the full-scale model for 12 steps in a pinned process (~10 s)
def test_under_the_pins_skipping_the_pad_rows_trains_the_same_bits() -> None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the pins need an x86-64 CPU with AVX2")
    checkout = str(Path(__file__).resolve().parents[1])
    env = {**pinned_env(os.environ), "PYTHONPATH": checkout}
    done = subprocess.run(
        [sys.executable, "-c", IDENTITY], env=env, capture_output=True, text=True, cwd=checkout
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bit-identical" in done.stdout
