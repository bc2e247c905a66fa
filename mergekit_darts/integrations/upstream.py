"""Work-arounds for traps in the libraries this package wraps (README, "Known issues").

- mergekit 0.1.5's ``gpt-neox`` architecture lists three attention buffers as required weights
  (``attention.bias``, ``attention.masked_bias``, ``attention.rotary_emb.inv_freq``) that
  transformers 5 no longer saves, so every GPT-NeoX merge of such checkpoints fails with
  "Tensor ... required but not present". :func:`neox_buffers_optional` marks them optional before
  a merge: mergekit then merges them when the inputs have them and skips them otherwise
  (transformers recomputes them on load).
- transformers 5 builds ``Qwen2Tokenizer`` (byte-level BPE from vocab + merges) for every
  ``model_type: qwen2`` folder, whatever ``tokenizer_class`` says, so a folder whose
  ``tokenizer.json`` holds another model (e.g. word-level) encodes differently from how it was
  saved. :func:`tokenizer_mismatch` detects that; the fix is a byte-level BPE tokenizer.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("mergekit_darts")

NEOX = "GPTNeoXForCausalLM"
NEOX_BUFFERS = (".attention.bias", ".attention.masked_bias", ".attention.rotary_emb.inv_freq")
_neox_patched = False
_warned: set[str] = set()  # folders already warned about


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


def tokenizer_mismatch(folder: str | Path, tokenizer: Any) -> str | None:
    """Why ``tokenizer`` (as transformers loaded it) encodes unlike ``folder/tokenizer.json``.

    Probes with text decoded from the file's own vocabulary; None when both agree or the folder
    has no ``tokenizer.json`` to compare with.
    """
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(str(path))
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(min(saved.get_vocab_size(), 256)) if i not in special]
    probe = saved.decode(ids)
    want = saved.encode(probe, add_special_tokens=False).ids
    got = tokenizer(probe, add_special_tokens=False)["input_ids"]
    if got == want:
        return None
    kind = json.loads(path.read_text(encoding="utf-8")).get("model", {}).get("type", "?")
    return (
        f"transformers loads the tokenizer of {folder} as {type(tokenizer).__name__}, which "
        f"encodes unlike its tokenizer.json (a {kind} model); calibration and evaluation use what "
        "transformers loads (for model_type qwen2, transformers 5 always builds Qwen2Tokenizer: "
        "give such models a byte-level BPE tokenizer)"
    )


def warn_tokenizer_mismatch(folder: str | Path, tokenizer: Any) -> None:
    """Log :func:`tokenizer_mismatch` once per folder."""
    key = str(Path(folder).resolve())
    if key not in _warned and (problem := tokenizer_mismatch(folder, tokenizer)):
        _warned.add(key)
        log.warning(problem)
