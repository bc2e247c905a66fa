"""``apply_surgery`` on a model shared by threads: each forward call uses its own positions."""

from __future__ import annotations

import threading
from typing import Any

import torch
from tiny import random_module
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import apply_surgery


def test_threads_sharing_a_corrected_model_get_their_own_positions(tiny_family: Any) -> None:
    """A barrier in the first decoder layer holds each call until the other is in flight too,
    so both reach the LM head with the other's positions read last (the bug this guards)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_family.base, dtype=torch.float32).eval()
    module = random_module("pos_corr", model.config.hidden_size, 4, 10, seed=0)
    left = AutoTokenizer.from_pretrained(tiny_family.base, padding_side="left")
    right = AutoTokenizer.from_pretrained(tiny_family.base, padding_side="right")
    inputs = [
        dict(left(tiny_family.prompts[:4], return_tensors="pt", padding=True)),
        dict(right(tiny_family.prompts[4:6], return_tensors="pt", padding=True)),
    ]
    handle = apply_surgery(model, module)
    with torch.no_grad():
        alone = [model(**x).logits for x in inputs]
    barrier = threading.Barrier(2, timeout=60)

    def meet(*_: Any) -> None:  # returns None: the layer's inputs stay as they are
        barrier.wait()

    layer = model.model.layers[0].register_forward_pre_hook(meet)
    results: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def run(which: int) -> None:
        try:
            for _ in range(3):
                with torch.no_grad():
                    results[which].append(model(**inputs[which]).logits)
        except BaseException as err:  # noqa: BLE001  (reported by the main thread)
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    layer.remove()
    handle.remove()
    assert not errors, errors
    for which in (0, 1):
        for logits in results[which]:
            torch.testing.assert_close(logits, alone[which], rtol=0, atol=1e-6)
