"""Exports of architectures vLLM serves only through its Transformers backend (Phi, GPT-NeoX).

vLLM 0.32 has no native class for them: they run as transformers' own model inside vLLM's
``TransformersForCausalLM``, which loads Phi's LM-head bias and renames GPT-NeoX's ``embed_out``
to ``lm_head``. The plugin's ``Darts<Arch>`` subclasses that backend class; the same checks as
for the native Llama class (continuous batching, chunked prefill, prefix caching) against a
float64 reference through each model's own head, one engine per model.
"""

from __future__ import annotations

import json

import pytest
from conftest import TRANSFORMERS_BACKEND, float64_reference
from test_vllm_plugin import TOL, check_batch, check_prefix_cache, start_engine


@pytest.mark.parametrize("model_type", list(TRANSFORMERS_BACKEND))
def test_the_transformers_backend(model_type: str, backend_exported) -> None:
    from vllm import ModelRegistry

    exported = backend_exported(model_type)
    config = json.loads((exported.dest / "config.json").read_text())
    # the premise: vLLM has no native class for it, so this is the Transformers backend's path
    arch = config["darts"]["base_architecture"]
    assert ModelRegistry.models[arch].module_name.endswith(".transformers"), arch
    reference = float64_reference(exported)
    llm = start_engine(exported)
    try:
        batch = check_batch(llm, exported.vocab_size, reference)
        cached = check_prefix_cache(llm, exported.vocab_size, reference)
    finally:
        del llm
    print(
        f"{arch}: largest log-prob error vs the float64 reference: {batch:.2e} (batch), "
        f"{cached:.2e} (prefix cache)"
    )
    assert batch < TOL and cached < TOL
