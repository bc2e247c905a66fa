"""Work-arounds for traps in the libraries this package wraps (docs/known-issues.md).

- mergekit 0.1.5's ``gpt-neox`` architecture lists three attention buffers as required weights
  (``attention.bias``, ``attention.masked_bias``, ``attention.rotary_emb.inv_freq``) that
  transformers 5 no longer saves, so every GPT-NeoX merge of such checkpoints fails with
  "Tensor ... required but not present". :func:`neox_buffers_optional` marks them optional before
  a merge: mergekit then merges them when the inputs have them and skips them otherwise
  (transformers recomputes them on load).

The other known trap, transformers 5 loading every ``model_type: qwen2`` tokenizer as
``Qwen2Tokenizer``, is detected where tokenizers are first compared, before the merge:
:func:`mergekit_darts.config.preflight.tokenizer_mismatch`.
"""

from __future__ import annotations

import json

NEOX = "GPTNeoXForCausalLM"
NEOX_BUFFERS = (".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq")
_neox_patched = False


def neox_buffers_optional() -> None:
    """Mark the GPT-NeoX buffers optional in mergekit's architecture table (idempotent)."""
    try:
        from importlib.resources import files

        import mergekit._data.architectures as data
        from mergekit.architecture import json_definitions as defs
    except ImportError:  # another mergekit layout: leave it alone
        return
    global _neox_patched
    known = defs.NAME_TO_ARCH.get(NEOX)
    if not known or _neox_patched:
        return
    spec = json.loads(files(data).joinpath("gpt-neox.json").read_text())
    for weight in spec["layer_templates"]["weights"]:
        if weight["name"].endswith(NEOX_BUFFERS):
            weight["optional"] = True
    patched = defs._load_architecture_json(json.dumps(spec))
    defs.NAME_TO_ARCH[NEOX] = [patched if arch is known[0] else arch for arch in known]
    _neox_patched = True
