"""vLLM serving exports of the real SmolLM2-135M-Instruct merge (`make test-real`, marker `real`).

The merge and its routed surgery block are tests/real.py's (stock ``mergekit-yaml``); the
``math`` (pos_corr) and ``--routed`` exports are made by the ``mergekit-darts export`` command.
Each engine's prompt and generated log-probs (the top 20 per position vLLM returns) and its greedy
tokens are compared with the merge in float64, corrected by the module formulas written here,
through the model's own tied head, on chat-template prompts batched together, one of them running
past max_positions.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from real import BIN, KINDS, MAX_POSITIONS, RealMerge, build_real_merge, chat
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts.routing import ROUTED

pytestmark = pytest.mark.real
TOP = 20  # log-probs per position: the full 49,152 would make every request slow
# float32 through 30 real layers (outlier dimensions reach hundreds) against float64: measured
# largest error about TODO
TOL = 2e-3
PROMPTS = [
    "What is 17 + 25?",
    "What does this print? x = 3; print(x * 7)",
    "Summarise: " + "the river runs past the old mill and the bridge, " * 6,
]


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> RealMerge:
    return build_real_merge(tmp_path_factory.mktemp("real"))


def float64_reference(real: RealMerge, task: str):
    """token ids -> [T, V] float64 log-probs with ``task``'s correction (or the routed one)."""
    model = AutoModelForCausalLM.from_pretrained(real.merged, dtype=torch.float64).eval()
    head = model.get_output_embeddings().weight  # the embedding: the head is tied
    assert head is model.get_input_embeddings().weight
    surgery = real.merged / "surgery"
    states = {name: load_file(surgery / f"{name}.safetensors") for name in KINDS}
    router = load_file(surgery / "router.safetensors")

    def correction(name: str, h: torch.Tensor) -> torch.Tensor:
        state = {k: v.double() for k, v in states[name].items()}
        c = torch.relu(h @ state["down.weight"].T) @ state["up.weight"].T
        if "position_bias" in state:
            p = torch.arange(h.shape[0])
            rows = state["position_bias"][p.clamp(max=MAX_POSITIONS - 1)]
            c = c + rows * (p < MAX_POSITIONS).double().unsqueeze(-1)
        return c

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            h = model.base_model(torch.tensor([ids])).last_hidden_state[0]
        if task == ROUTED:  # gate over the tasks, in block order, plus a last "none" class
            gate = torch.softmax(h @ router["weight"].double().T + router["bias"].double(), -1)
            total = sum(gate[:, k : k + 1] * correction(n, h) for k, n in enumerate(KINDS))
            h_hat = h - total
        else:
            h_hat = h - correction(task, h)
        return torch.log_softmax(h_hat @ head.T, dim=-1)

    return run


def check(output, reference) -> float:
    """Greedy tokens equal the reference's argmax; returns the largest log-prob error."""
    prompt_ids, generated = list(output.prompt_token_ids), output.outputs[0]
    ids = prompt_ids + list(generated.token_ids)
    ref = reference(ids)
    n = len(prompt_ids)
    assert list(generated.token_ids) == ref[n - 1 : len(ids) - 1].argmax(-1).tolist()
    rows = [*output.prompt_logprobs[1:], *generated.logprobs]  # what predicts ids[1:]
    assert len(rows) == len(ids) - 1
    error = 0.0
    for i, row in enumerate(rows):
        for token, logprob in row.items():
            error = max(error, abs(logprob.logprob - float(ref[i, token])))
    return error


@pytest.mark.parametrize("task", ["math", ROUTED])
def test_vllm_serves_the_real_export(real: RealMerge, task: str, tmp_path: Path) -> None:
    from vllm import LLM, SamplingParams

    dest = tmp_path / "export"
    option = ["--routed"] if task == ROUTED else ["--task", task]
    subprocess.run([BIN / "mergekit-darts", "export", real.merged, *option, dest], check=True)
    tokenizer = AutoTokenizer.from_pretrained(real.merged)
    prompts = [chat(tokenizer, p) for p in PROMPTS]
    assert len(tokenizer(prompts[-1])["input_ids"]) > MAX_POSITIONS
    llm = LLM(
        model=str(dest),
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        max_model_len=256,
        max_logprobs=TOP,
        seed=0,
    )
    try:
        params = SamplingParams(
            temperature=0, max_tokens=8, logprobs=TOP, prompt_logprobs=TOP, ignore_eos=True
        )
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm
    reference = float64_reference(real, task)
    error = max(check(output, reference) for output in outputs)
    print(f"{task}: largest log-prob error vs the float64 reference: {error:.2e}")
    assert error < TOL
