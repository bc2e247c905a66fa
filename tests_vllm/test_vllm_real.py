"""vLLM serving a ``--routed`` export of the real SmolLM2-135M-Instruct (`make test-real`).

The pretrained model (demo.smollm2) gets a random routed surgery (the routed
fixture's tasks: pos_corr, none and standard modules, background, every weight non-zero and small), is
exported by the ``mergekit-darts export --routed`` command and served by ``LLM(model=DEST)``: one
engine, chat-template prompts batched together, one shorter and the others longer than
max_positions. Greedy tokens and the top-20 prompt and generated log-probs per position are
compared with the float64 reference of the routed formula through the model's own tied head. The
merge, calibration, ``hf-darts`` and the single-task export on the real model are in
tests/test_real.py (no vLLM needed there).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import (
    BIN,
    MAX_POSITIONS,
    MEMORY_SHARE,
    RANK,
    ROUTED_KINDS,
    Exported,
    routed_float64_reference,
)
from real import chat
from tiny import write_routed_surgery
from transformers import AutoConfig, AutoTokenizer

from demo.smollm2 import smollm2_folder
from mergekit_darts.folder.artifacts import load_routed

pytestmark = pytest.mark.real
# module weights' standard deviation: the tiny fixtures' 0.3 swamps the real hidden states, and
# float32 log-probs of logits that large were 9.9e-4 off the float64 ones
SCALE = 0.03
TOP = 20  # log-probs per position: all 49,152 would make every request slow
# float32 through 30 real layers (activations up to a few hundred) against float64: the tiny
# models' 1e-5 does not hold; measured largest error 5.1e-5 here
TOL = 5e-4
PROMPTS = [
    "What is 17 + 25?",
    "What does this Python code print? x = 3; print(x * 7)",
    "Summarise: " + "the river runs past the old mill and the bridge, " * 6,
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    root = tmp_path_factory.mktemp("real_vllm")
    base = smollm2_folder()
    merged = Path(shutil.copytree(base, root / "merged", copy_function=os.symlink))
    hidden = AutoConfig.from_pretrained(merged).hidden_size
    write_routed_surgery(
        merged / "surgery",
        hidden,
        ROUTED_KINDS,
        rank=RANK,
        max_positions=MAX_POSITIONS,
        scale=SCALE,
    )
    dest = root / "routed"
    subprocess.run([BIN / "mergekit-darts", "export", merged, "--routed", dest], check=True)
    vocab = AutoConfig.from_pretrained(merged).vocab_size
    return Exported(merged, dest, load_routed(merged / "surgery"), vocab)


def check(output, reference) -> float:
    """Greedy tokens equal the reference's argmax; returns the largest log-prob error."""
    prompt_ids, generated = list(output.prompt_token_ids), output.outputs[0]
    ids = prompt_ids + list(generated.token_ids)
    ref = reference(ids)
    n = len(prompt_ids)
    assert list(generated.token_ids) == ref[n - 1 : len(ids) - 1].argmax(-1).tolist()
    rows = [*output.prompt_logprobs[1:], *generated.logprobs]  # what predicts ids[1:]
    assert len(rows) == len(ids) - 1
    return max(
        abs(logprob.logprob - float(ref[i, token]))
        for i, row in enumerate(rows)
        for token, logprob in row.items()
    )


def test_vllm_serves_the_real_routed_export(exported: Exported) -> None:
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(exported.merged)
    prompts = [chat(tokenizer, p) for p in PROMPTS]
    lengths = [len(tokenizer(p)["input_ids"]) for p in prompts]
    assert min(lengths) < MAX_POSITIONS < max(lengths)
    llm = LLM(
        model=str(exported.dest),
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=256,
        max_logprobs=TOP,
        seed=0,
        gpu_memory_utilization=MEMORY_SHARE,
    )
    try:
        params = SamplingParams(
            temperature=0, max_tokens=8, logprobs=TOP, prompt_logprobs=TOP, ignore_eos=True
        )
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm
    reference = routed_float64_reference(exported)
    error = max(check(output, reference) for output in outputs)
    print(f"largest log-prob error vs the float64 reference: {error:.2e}")
    assert error < TOL
    plain = reference(list(outputs[2].prompt_token_ids), surgery=False)
    assert (plain - reference(list(outputs[2].prompt_token_ids))).abs().max() > 1e-2
