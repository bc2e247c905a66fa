"""llama.cpp itself on the real SmolLM2-135M plain export (`make test-llamacpp`; outside CI).

The merge with its fitted ``head`` correction is tests/real_plain.py's; llama.cpp's converter
(tests/llamacpp.py) writes the plain export and, for the uncorrected baseline, the merge itself as
GGUF; llama.cpp's quantizer makes the Q4 files from the F32 ones. llama-cpp-python, built from the
same pinned sdist into ``.venv-llamacpp``, runs them in a subprocess (tests_llamacpp/llama_worker.py)
with a float32 KV cache.

- F32: llama.cpp's greedy tokens are ``apply_surgery``'s (transformers' greedy ``generate`` on the
  merged folder), and its logits along them are within F32_TOLERANCE.
- Q8_0, Q4_0, Q4_K_M: how much of the correction survives. Its change of the logits is corrected
  minus uncorrected: in float32 transformers (``apply_surgery``, the merge without it) and in
  llama.cpp at each type (the plain export and the merge, each quantized alike). Printed: the share
  kept (the quantized change projected on the float32 one), what the quantized change holds
  besides it, the distance of the quantized plain export and of the quantized merge to the float32
  corrected logits (each relative to the size of the float32 change), how much of the float32
  corrected greedy continuations each reproduces, and the types stored. The untied head changes
  how llama.cpp's quantizer treats the embedding: the tied merge's embedding is its output and
  stays Q8_0, the plain export's is an input only and goes to Q4_0 (Q5_0 under Q4_K_M), so each Q4
  type is measured as llama.cpp makes it and with ``--token-embedding-type q8_0``. Checked: the
  quantized plain export is nearer the float32 corrected logits than the quantized merge.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llamacpp import VERSION, convert, read_gguf
from real import chat
from real_plain import TASK, PlainMerge, build_plain_merge
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import apply_surgery

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[1]
LLAMA_PYTHON = ROOT / ".venv-llamacpp" / "bin" / "python"
WORKER = Path(__file__).with_name("llama_worker.py")
NEW_TOKENS = 32
# float32 throughout, in other kernels: the fold's own rounding (5.5e-5 in transformers), summation
# order, ggml's exp and silu; measured 8.3e-5. llama.cpp's default float16 KV cache alone moves
# these logits by 0.05
F32_TOLERANCE = 1e-3
CONVERTED = {"F32": "f32", "Q8_0": "q8_0"}  # made by convert_hf_to_gguf.py --outtype
# made by llama.cpp's quantizer from the F32 file: name -> (file type, token embedding type)
QUANTIZED = {
    "Q4_0": ("Q4_0", None),
    "Q4_0 emb Q8_0": ("Q4_0", "Q8_0"),
    "Q4_K_M": ("Q4_K_M", None),
    "Q4_K_M emb Q8_0": ("Q4_K_M", "Q8_0"),
}
VERSIONS = ("corrected", "uncorrected")  # the plain export, the merge without its correction


@pytest.fixture(scope="module")
def llama_python() -> Path:
    found = (
        subprocess.run(
            [LLAMA_PYTHON, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
            capture_output=True,
            text=True,
        )
        if LLAMA_PYTHON.exists()
        else None
    )
    if found is None or found.stdout.strip() != VERSION:
        pytest.fail(
            f"{LLAMA_PYTHON} lacks llama-cpp-python {VERSION}: rm -rf .venv-llamacpp and run make test-llamacpp"
        )
    return LLAMA_PYTHON


@pytest.fixture(scope="module")
def merge(tmp_path_factory: pytest.TempPathFactory) -> PlainMerge:
    return build_plain_merge(tmp_path_factory.mktemp("real_plain"))


@pytest.fixture(scope="module")
def ggufs(merge: PlainMerge, llama_python: Path) -> dict[tuple[str, str], Path]:
    folder = merge.plain.parent / "gguf"
    folder.mkdir()
    sources = {"corrected": merge.plain, "uncorrected": merge.merged}
    files = {}
    for version, source in sources.items():
        for kind, outtype in CONVERTED.items():
            files[version, kind] = folder / f"{version}-{kind}.gguf"
            convert(source, files[version, kind], outtype)
        for kind, (ftype, embedding) in QUANTIZED.items():
            files[version, kind] = folder / f"{version}-{kind.replace(' ', '-')}.gguf"
            worker = [llama_python, WORKER, "quantize", files[version, "F32"], files[version, kind]]
            worker += [ftype] if embedding is None else [ftype, embedding]
            subprocess.run(worker, check=True, capture_output=True)
    return files


@pytest.fixture(scope="module")
def reference(merge: PlainMerge) -> dict[str, Any]:
    """The held-out chat prompts, transformers' greedy continuation of each with and without the
    correction, and the logits of both along the corrected continuation (float32)."""
    tokenizer = AutoTokenizer.from_pretrained(merge.merged)
    prompts = [
        tokenizer(chat(tokenizer, p), add_special_tokens=False)["input_ids"] for p in merge.prompts
    ]
    model = AutoModelForCausalLM.from_pretrained(merge.merged, dtype=torch.float32).eval()
    settings = dict(do_sample=False, max_new_tokens=NEW_TOKENS)

    def greedy(ids: list[int]) -> list[int]:
        with torch.no_grad():
            return model.generate(torch.tensor([ids]), **settings)[0, len(ids) :].tolist()

    def logits(sequences: list[list[int]]) -> list[torch.Tensor]:
        with torch.no_grad():
            return [model(input_ids=torch.tensor([s])).logits[0] for s in sequences]

    uncorrected_tokens = [greedy(p) for p in prompts]
    with apply_surgery(model, merge.merged / "surgery", TASK):
        tokens = [greedy(p) for p in prompts]
        sequences = [p + t for p, t in zip(prompts, tokens, strict=True)]
        corrected = logits(sequences)
    eos = model.generation_config.eos_token_id
    return {
        "prompts": prompts,
        "tokens": {"corrected": tokens, "uncorrected": uncorrected_tokens},
        "sequences": sequences,
        "logits": {"corrected": corrected, "uncorrected": logits(sequences)},
        "eos": [eos] if isinstance(eos, int) else list(eos),
    }


def llama_cpp_run(llama_python: Path, gguf: Path, reference: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's logits along the reference sequences and its greedy continuations."""
    request = gguf.with_suffix(".request.json")
    keys = ("prompts", "sequences", "eos")
    request.write_text(json.dumps({k: reference[k] for k in keys} | {"new_tokens": NEW_TOKENS}))
    out = gguf.with_suffix(".npz")
    subprocess.run([llama_python, WORKER, "run", gguf, request, out], check=True)
    with np.load(out) as arrays:
        n = len(reference["sequences"])
        return {
            "logits": [torch.from_numpy(arrays[f"logits_{i}"]) for i in range(n)],
            "tokens": [arrays[f"tokens_{i}"].tolist() for i in range(len(reference["prompts"]))],
        }


def test_llama_cpp_f32_gives_apply_surgerys_greedy_tokens_and_logits(
    llama_python: Path, ggufs: dict[tuple[str, str], Path], reference: dict[str, Any]
) -> None:
    got = llama_cpp_run(llama_python, ggufs["corrected", "F32"], reference)
    error = max(
        float((g - e).abs().max())
        for g, e in zip(got["logits"], reference["logits"]["corrected"], strict=True)
    )
    print(f"llama.cpp F32 (F32 KV cache): max |logits - apply_surgery| {error:.2e}")
    assert got["tokens"] == reference["tokens"]["corrected"]
    assert error <= F32_TOLERANCE


def greedy_kept(got: list[list[int]], wanted: list[list[int]]) -> int:
    """How many of ``wanted``'s tokens ``got`` reproduces before its first different one."""
    kept = 0
    for ours, theirs in zip(got, wanted, strict=True):
        same = 0
        while same < min(len(ours), len(theirs)) and ours[same] == theirs[same]:
            same += 1
        kept += same
    return kept


def test_what_quantization_keeps_of_the_correction(
    llama_python: Path, ggufs: dict[tuple[str, str], Path], reference: dict[str, Any]
) -> None:
    logits, tokens = reference["logits"], reference["tokens"]
    target = torch.cat(logits["corrected"]).double()
    wanted = target - torch.cat(logits["uncorrected"]).double()
    size = wanted.norm()
    total = sum(len(t) for t in tokens["corrected"])
    uncorrected = greedy_kept(tokens["uncorrected"], tokens["corrected"])
    print(
        f"\nfloat32 merge without the correction: {uncorrected} of {total} corrected greedy tokens"
    )
    print("type             kept  besides  plain→F32  merge→F32  greedy    corrected file's types")
    for kind in ("F32", "Q8_0", *QUANTIZED):
        runs = {v: llama_cpp_run(llama_python, ggufs[v, kind], reference) for v in VERSIONS}
        ours, theirs = (torch.cat(runs[v]["logits"]).double() for v in VERSIONS)
        change = ours - theirs
        share = float((change * wanted).sum() / (wanted * wanted).sum())
        besides = float((change - wanted).norm() / size)
        near, far = float((ours - target).norm() / size), float((theirs - target).norm() / size)
        kept = greedy_kept(runs["corrected"]["tokens"], tokens["corrected"])
        types = sorted(set(read_gguf(ggufs["corrected", kind])["tensors"].values()))
        row = f"{kind:<15} {share:5.3f}  {besides:7.3f}  {near:9.3f}  {far:9.3f}"
        print(f"{row}  {kept:>3} of {total}  {types}")
        assert near < far, kind
