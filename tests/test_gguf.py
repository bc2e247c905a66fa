"""A plain export of the real SmolLM2-135M-Instruct through llama.cpp's own GGUF converter
(`make test-real`; marker `real`): a fitted ``head`` correction (tests/real_plain.py), untied into
its own head, converted by ``convert_hf_to_gguf.py`` from the pinned llama-cpp-python sdist
(tests/llamacpp.py) and read back by transformers (``gguf_file=``).

- F32: the corrected merge, ``apply_surgery``'s logits within 1e-4.
- F16 and Q8_0: the format's own rounding of the corrected tensors, and nothing else. The
  reference is the plain export with every tensor the GGUF stores as F16 rounded to float16 (round
  to nearest even: relative error at most 2^-11) and every Q8_0 tensor quantized as Q8_0 defines it
  (blocks of 32 along a row, scale d = max |x| / 127 kept as float16, q = x / d rounded half away
  from zero, read back as q * d: error at most d / 2 per weight), run in float32. The GGUF read back
  must give that reference's logits within 1e-4, the F32 tolerance. Against ``apply_surgery`` its
  error is then the format's precision alone: the reference's own deviation, plus 1e-4.
- Tensor names: exactly the checkpoint's tensors under llama's GGUF names, ``output.weight``
  present (the untied head), no ``output.bias``, each one llama defines.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from llamacpp import SDIST, check_sdist, convert, read_gguf
from real import chat
from real_plain import TASK, PlainMerge, build_plain_merge
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import apply_surgery

OUTTYPES = {"f32": "F32", "f16": "F16", "q8_0": "Q8_0"}  # converter --outtype -> GGUF storage
F32_TOLERANCE = 1e-4
Q8_0_BLOCK = 32
# the checkpoint's Llama tensor names -> llama.cpp's GGUF names
GGUF_NAMES = {
    r"model\.embed_tokens\.weight": "token_embd.weight",
    r"lm_head\.weight": "output.weight",
    r"model\.norm\.weight": "output_norm.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": r"blk.\1.attn_norm.weight",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": r"blk.\1.ffn_norm.weight",
    r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.weight": r"blk.\1.attn_\2.weight",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": r"blk.\1.attn_output.weight",
    r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight": r"blk.\1.ffn_\2.weight",
}


def gguf_name(name: str) -> str:
    for pattern, replacement in GGUF_NAMES.items():
        if re.fullmatch(pattern, name):
            return re.sub(pattern, replacement, name)
    raise AssertionError(f"no GGUF name for checkpoint tensor {name}")


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> PlainMerge:
    return build_plain_merge(tmp_path_factory.mktemp("real_plain"))


@pytest.fixture(scope="module")
def ggufs(merge: PlainMerge) -> dict[str, Path]:
    folder = merge.plain.parent / "gguf"
    folder.mkdir()
    files = {}
    for outtype in OUTTYPES:
        files[outtype] = folder / f"plain-{outtype}.gguf"
        seconds = convert(merge.plain, files[outtype], outtype)
        size = files[outtype].stat().st_size / 2**20
        print(f"convert_hf_to_gguf.py --outtype {outtype}: {seconds:.1f} s, {size:.0f} MiB")
    return files


@pytest.fixture(scope="module")
def prompts(merge: PlainMerge) -> list[torch.Tensor]:
    """The held-out prompts through the chat template, one unpadded sequence each."""
    tokenizer = AutoTokenizer.from_pretrained(merge.merged)
    texts = [chat(tokenizer, p) for p in merge.prompts]
    return [tokenizer(t, return_tensors="pt", add_special_tokens=False)["input_ids"] for t in texts]


def logits(model: Any, prompts: list[torch.Tensor]) -> torch.Tensor:
    """Every position's logits of every prompt, one row each."""
    with torch.no_grad():
        return torch.cat([model(input_ids=ids).logits[0] for ids in prompts])


@pytest.fixture(scope="module")
def surgery(merge: PlainMerge, prompts: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """``apply_surgery``'s logits on the merged folder, and the merge's without it."""
    model = AutoModelForCausalLM.from_pretrained(merge.merged, dtype=torch.float32).eval()
    uncorrected = logits(model, prompts)
    with apply_surgery(model, merge.merged / "surgery", TASK):
        corrected = logits(model, prompts)
    return {"corrected": corrected, "uncorrected": uncorrected}


def read_back(gguf: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """Q8_0 of a float32 matrix and back, as the format defines it, in float32."""
    blocks = weight.reshape(-1, Q8_0_BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    q = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return (q * d.half().float()).reshape(weight.shape)


ROUNDING = {"F32": lambda w: w, "F16": lambda w: w.half().float(), "Q8_0": q8_0}


def format_reference(plain: Path, stored: dict[str, str]) -> Any:
    """The plain export with each tensor rounded as the GGUF stores it."""
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(ROUNDING[stored[gguf_name(name)]](parameter))
    return model


@pytest.mark.real
def test_the_f32_gguf_is_the_corrected_merge(
    ggufs: dict[str, Path], surgery: dict[str, torch.Tensor], prompts: list[torch.Tensor]
) -> None:
    got = logits(read_back(ggufs["f32"]), prompts)
    expected = surgery["corrected"]
    assert (got - expected).abs().max() <= F32_TOLERANCE
    change = (expected - surgery["uncorrected"]).abs().max()
    print(
        f"F32: max |GGUF - apply_surgery| {(got - expected).abs().max():.2e}; correction {change:.3f}"
    )
    assert change > 0.1  # the correction is really there


@pytest.mark.real
@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_f16_and_q8_0_are_the_formats_rounding_of_the_corrected_tensors(
    merge: PlainMerge,
    ggufs: dict[str, Path],
    surgery: dict[str, torch.Tensor],
    prompts: list[torch.Tensor],
    outtype: str,
) -> None:
    stored = read_gguf(ggufs[outtype])["tensors"]
    with safe_open(str(merge.plain / "model.safetensors"), framework="pt") as tensors:
        ranks = {gguf_name(n): len(tensors.get_slice(n).get_shape()) for n in tensors.keys()}  # noqa: SIM118
    # every matrix in the format, the norms' vectors kept float32 by the converter
    assert {n: t for n, t in stored.items() if ranks[n] == 2} == {
        n: OUTTYPES[outtype] for n in stored if ranks[n] == 2
    }
    assert {stored[n] for n in stored if ranks[n] == 1} == {"F32"}
    got = logits(read_back(ggufs[outtype]), prompts)
    reference = logits(format_reference(merge.plain, stored), prompts)
    expected = surgery["corrected"]
    precision = (reference - expected).abs().max()
    error = (got - expected).abs().max()
    change = (expected - surgery["uncorrected"]).abs()
    print(
        f"{OUTTYPES[outtype]}: max |GGUF - format reference| {(got - reference).abs().max():.2e}, "
        f"max |GGUF - apply_surgery| {error:.4f} (the format's rounding alone: {precision:.4f}); "
        f"correction max {change.max():.3f}, mean {change.mean():.4f}"
    )
    assert (got - reference).abs().max() <= F32_TOLERANCE
    assert error <= precision + F32_TOLERANCE


@pytest.mark.real
def test_the_gguf_holds_exactly_the_architectures_tensors(
    merge: PlainMerge, ggufs: dict[str, Path]
) -> None:
    config = json.loads((merge.plain / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # head untied the tied head
    with safe_open(str(merge.plain / "model.safetensors"), framework="pt") as tensors:
        expected = {gguf_name(n) for n in tensors.keys()}  # noqa: SIM118
    assert "output.weight" in expected and len(expected) == 2 + 1 + 30 * 9
    for gguf in ggufs.values():
        read = read_gguf(gguf)
        assert read["architecture"] == "llama"
        assert set(read["tensors"]) == expected, gguf.name
        assert "output.bias" not in read["tensors"]
        assert set(read["tensors"]) <= set(read["defined"])


def test_a_changed_sdist_is_refused_in_one_line(tmp_path: Path) -> None:
    changed = tmp_path / "llama_cpp_python.tar.gz"
    changed.write_bytes(b"not the pinned sdist")
    with pytest.raises(RuntimeError, match=f"not the pinned .*{SDIST} changed") as err:
        check_sdist(changed)
    assert "\n" not in str(err.value)
