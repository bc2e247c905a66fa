"""The real SmolLM2-135M-Instruct end to end (`make test-real`; marker `real`, off by default).

What tiny models never exercise: a 49,152-token byte-level BPE tokenizer with a ChatML chat
template, tied input/output embeddings, 30 layers with real activation statistics. One stock
``mergekit-yaml`` run with a routed surgery block (tests/real.py) feeds every test: the merge is
task arithmetic, checked in float64 here; the modules move the merge toward each expert (float64
formulas written here); ``hf-darts`` equals ``apply_surgery`` and the float64 reference; a
single-task and a ``--routed`` export, loaded in an interpreter that cannot import
mergekit-darts, give ``apply_surgery``'s logits and greedy tokens, through the tied head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from real import (
    KINDS,
    MAX_POSITIONS,
    N_PROMPTS,
    PERTURBED_LAYERS,
    WEIGHT,
    RealMerge,
    build_real_merge,
    chat,
)
from reference import instance, logits_without_darts
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lm_eval_darts.model import DartsHFLM
from mergekit_darts import apply_surgery
from mergekit_darts.hosts.deploy.export import export
from mergekit_darts.task_map import ROUTED

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> RealMerge:
    return build_real_merge(tmp_path_factory.mktemp("real"))


@pytest.fixture(scope="module")
def tokenizer(real: RealMerge) -> Any:
    return AutoTokenizer.from_pretrained(real.merged)


@pytest.fixture(scope="module")
def plain(real: RealMerge) -> Any:
    return AutoModelForCausalLM.from_pretrained(real.merged, dtype=torch.float32).eval()


LONG = "Summarise: " + "the river runs past the old mill and the bridge, " * 6  # > MAX_POSITIONS


@pytest.fixture(scope="module")
def batch(tokenizer: Any) -> dict[str, torch.Tensor]:
    """Left-padded chat prompts of very different lengths; the longest runs past max_positions."""
    prompts = ["What is 17 + 25?", "What does this print? x = 3; print(x * 7)", LONG]
    tokenizer.padding_side = "left"
    encoded = tokenizer([chat(tokenizer, p) for p in prompts], return_tensors="pt", padding=True)
    lengths = encoded["attention_mask"].sum(-1).tolist()
    assert max(lengths) > MAX_POSITIONS > min(lengths)
    return dict(encoded)


def module_state(real: RealMerge, task: str) -> dict[str, torch.Tensor]:
    return {
        k: v.double() for k, v in load_file(real.merged / "surgery" / f"{task}.safetensors").items()
    }


def corrected64(state: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """h - relu(h D^T) U^T - b_p for one unpadded sequence (positions 0..T-1), in float64; no
    position rows for a standard module, none from max_positions on."""
    h = h.double()
    h_hat = h - torch.relu(h @ state["down.weight"].T) @ state["up.weight"].T
    if "position_bias" in state:
        p = torch.arange(h.shape[0])
        rows = state["position_bias"][p.clamp(max=MAX_POSITIONS - 1)]
        h_hat = h_hat - rows * (p < MAX_POSITIONS).double().unsqueeze(-1)
    return h_hat


def final_hidden(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def test_the_merge_is_task_arithmetic_and_keeps_the_tied_head(real: RealMerge) -> None:
    names = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    names += [f"model.layers.{n}.mlp.down_proj.weight" for n in PERTURBED_LAYERS]
    with safe_open(str(real.merged / "model.safetensors"), framework="pt") as merged:
        assert "lm_head.weight" not in list(merged.keys())  # tied: the head is the embedding
        base_tensors = load_file(real.base / "model.safetensors")
        for name in names:
            base = base_tensors[name].double()
            expected = base.clone()
            for expert in real.experts.values():
                with safe_open(str(expert / "model.safetensors"), framework="pt") as tensors:
                    expected += WEIGHT * (tensors.get_tensor(name).double() - base)
            torch.testing.assert_close(
                merged.get_tensor(name).double(), expected, rtol=0, atol=1e-6
            )
    config = json.loads((real.merged / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == 49152
    model = AutoModelForCausalLM.from_pretrained(real.merged, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ours, base = (
        AutoTokenizer.from_pretrained(real.merged),
        AutoTokenizer.from_pretrained(real.base),
    )
    assert ours.chat_template == base.chat_template and ours.chat_template
    text = chat(ours, LONG)
    assert ours(text)["input_ids"] == base(text)["input_ids"]
    assert ours.model_max_length == 8192 and ours.eos_token == "<|im_end|>"


def test_the_modules_move_the_merge_toward_each_expert(
    real: RealMerge, plain: Any, tokenizer: Any
) -> None:
    """On each task's calibration prompts (chat template), in float64 from the saved tensors."""
    for task in KINDS:
        expert = AutoModelForCausalLM.from_pretrained(real.experts[task], dtype=torch.float32)
        state = module_state(real, task)
        before = after = 0.0
        for prompt in real.prompts[task]:
            ids = tokenizer(chat(tokenizer, prompt), add_special_tokens=False)["input_ids"]
            target = final_hidden(expert.eval(), ids).double()
            h = final_hidden(plain, ids)
            before += float((target - h.double()).abs().mean())
            after += float((target - corrected64(state, h)).abs().mean())
        print(f"{task}: mean |h_expert - h| {before / N_PROMPTS:.4f} -> {after / N_PROMPTS:.4f}")
        assert after < 0.9 * before, task


def test_hf_darts_equals_apply_surgery_and_a_float64_reference(
    real: RealMerge, plain: Any, tokenizer: Any, batch: dict[str, torch.Tensor]
) -> None:
    lm = DartsHFLM(pretrained=str(real.merged), surgery="math", device="cpu", dtype="float32")
    state = module_state(real, "math")
    head = plain.get_output_embeddings().weight.detach().double()
    pairs = [(chat(tokenizer, "What is 17 + 25?"), "42"), (chat(tokenizer, LONG), "The river")]
    requests = [instance("loglikelihood", pair, "real", i) for i, pair in enumerate(pairs)]
    for (context, continuation), (logprob, _) in zip(
        pairs, lm.loglikelihood(requests), strict=True
    ):
        ctx, cont = lm._encode_pair(context, continuation)
        ids = ctx + cont[:-1]
        reference = torch.log_softmax(corrected64(state, final_hidden(plain, ids)) @ head.T, -1)
        expected = reference[-len(cont) :].gather(1, torch.tensor(cont)[:, None]).sum()
        assert logprob == pytest.approx(float(expected), abs=1e-3)
    for task in ("math", ROUTED):
        lm.set_surgery(task, str(real.merged / "surgery"))
        with torch.no_grad():
            got = lm.model(**batch).logits
        model = AutoModelForCausalLM.from_pretrained(real.merged, dtype=torch.float32).eval()
        with apply_surgery(model, real.merged / "surgery", task), torch.no_grad():
            expected = model(**batch).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def exported(real: RealMerge, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("real_export")
    export(real.merged, root / "math", task="math")
    export(real.merged, root / ROUTED, routed=True)
    return {"math": root / "math", ROUTED: root / ROUTED}


def test_exports_load_without_mergekit_darts_and_equal_apply_surgery(
    real: RealMerge, exported: dict[str, Path], batch: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    folders = {task: str(folder) for task, folder in exported.items()}
    logits = logits_without_darts(list(folders.values()), batch, tmp_path)
    real_tokens = batch["attention_mask"].bool()
    for task, folder in folders.items():
        model = AutoModelForCausalLM.from_pretrained(real.merged, dtype=torch.float32).eval()
        with torch.no_grad():
            uncorrected = model(**batch).logits
            with apply_surgery(model, real.merged / "surgery", task):
                expected = model(**batch).logits
        torch.testing.assert_close(
            logits[folder][real_tokens], expected[real_tokens], rtol=0, atol=1e-5
        )
        assert (uncorrected - expected)[real_tokens].abs().max() > 0.1, task  # it is there


def test_exports_keep_the_tied_head_and_the_chat_template(
    real: RealMerge, exported: dict[str, Path]
) -> None:
    for folder in exported.values():
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        assert model.config.tie_word_embeddings is True
        assert model.lm_head.weight is model.model.embed_tokens.weight
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        assert tokenizer.chat_template == AutoTokenizer.from_pretrained(real.base).chat_template


def test_export_generates_what_apply_surgery_generates(
    real: RealMerge, exported: dict[str, Path], batch: dict[str, torch.Tensor], tokenizer: Any
) -> None:
    """Greedy, KV-cached, stopping at the chat template's end-of-turn token."""

    def generate(model: Any) -> torch.Tensor:
        return model.generate(**batch, max_new_tokens=8, do_sample=False)

    for task, folder in exported.items():
        ours = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        reference = AutoModelForCausalLM.from_pretrained(real.merged, dtype=torch.float32).eval()
        with apply_surgery(reference, real.merged / "surgery", task):
            assert torch.equal(generate(ours), generate(reference)), task
    assert ours.generation_config.eos_token_id == tokenizer.eos_token_id


def test_a_bfloat16_export_keeps_the_surgery_float32_and_the_head_tied(
    exported: dict[str, Path], batch: dict[str, torch.Tensor]
) -> None:
    """The real model in bfloat16 (what a GPU user loads): the surgery stays float32, the head
    stays tied, and next-token predictions stay those of float32 on nearly every token."""
    full = AutoModelForCausalLM.from_pretrained(exported["math"], trust_remote_code=True).eval()
    half = AutoModelForCausalLM.from_pretrained(
        exported["math"], trust_remote_code=True, dtype=torch.bfloat16
    ).eval()
    assert half.lm_head.weight is half.model.embed_tokens.weight
    assert half.lm_head.weight.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in half.darts_surgery.parameters())
    real_tokens = batch["attention_mask"].bool()
    with torch.no_grad():
        want = full(**batch).logits[real_tokens]
        got = half(**batch).logits[real_tokens].float()
    agreement = (want.argmax(-1) == got.argmax(-1)).double().mean()
    print(f"bfloat16 vs float32: top-1 agreement {agreement:.3f}")
    assert agreement > 0.9
