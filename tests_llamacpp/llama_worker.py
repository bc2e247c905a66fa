"""llama.cpp's side of tests_llamacpp, run by ``.venv-llamacpp/bin/python`` (llama-cpp-python and
numpy only: no torch, no transformers, no mergekit-darts).

``llama_worker.py quantize IN.gguf OUT.gguf TYPE [EMBEDDING_TYPE]``: llama.cpp's own quantizer
(``llama_model_quantize``, ``LLAMA_FTYPE_MOSTLY_<TYPE>``), the token embedding as
``GGML_TYPE_<EMBEDDING_TYPE>`` where given (``llama-quantize --token-embedding-type``).
``llama_worker.py run MODEL.gguf REQUEST.json OUT.npz``: for each of the request's ``sequences``,
the logits of every position (``logits_<i>``); for each of its ``prompts``, llama.cpp's greedy
continuation (its greedy sampler, ``temp=0``) of at most ``new_tokens`` tokens, ending at an
``eos`` token (``tokens_<i>``). The KV cache is float32 (``type_k = type_v = 0``): llama.cpp's
default float16 cache alone moves the logits by a few hundredths.
"""

from __future__ import annotations

import ctypes
import json
import sys

import llama_cpp
import numpy as np

GGML_TYPE_F32 = 0


def quantize(source: str, dest: str, kind: str, embedding: str | None = None) -> None:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    if embedding is not None:
        params.token_embedding_type = getattr(llama_cpp, f"GGML_TYPE_{embedding}")
    params.nthread = 2
    if llama_cpp.llama_model_quantize(source.encode(), dest.encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed: {source} -> {dest} ({kind})")


def run(model: str, request_file: str, out: str) -> None:
    with open(request_file, encoding="utf-8") as handle:
        request = json.load(handle)
    longest = max(len(s) for s in request["sequences"] + request["prompts"])
    n_ctx = longest + request["new_tokens"] + 1
    llm = llama_cpp.Llama(
        model_path=model,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=n_ctx,
        n_threads=2,
        logits_all=True,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        seed=0,
        verbose=False,
    )
    arrays = {}
    for i, sequence in enumerate(request["sequences"]):
        llm.reset()
        llm.eval(sequence)
        arrays[f"logits_{i}"] = np.array(llm.scores[: len(sequence)], dtype=np.float32)
    for i, prompt in enumerate(request["prompts"]):
        llm.reset()
        tokens = []
        for token in llm.generate(prompt, temp=0.0, repeat_penalty=1.0, reset=True):
            tokens.append(token)
            if token in request["eos"] or len(tokens) == request["new_tokens"]:
                break
        arrays[f"tokens_{i}"] = np.array(tokens, dtype=np.int64)
    np.savez(out, **arrays)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"quantize": quantize, "run": run}[command](*args)
