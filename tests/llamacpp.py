"""llama.cpp's own GGUF converter, from the pinned llama-cpp-python sdist.

``convert_hf_to_gguf.py``, its ``conversion/`` package and the ``gguf-py`` it is written against
are pure Python inside the sdist's ``vendor/llama.cpp``. PyPI's ``gguf`` 0.19 predates this
converter (it lacks ``LazyChunkedTensor``), so the converter and ``GGUFReader`` run against the
vendored ``gguf-py`` in a subprocess: transformers, in the test process, reads GGUF files through
PyPI's ``gguf`` (the ``real`` extra). The sdist is downloaded once into the real-model cache
(``demo.smollm2.default_cache``), checked against its pinned sha256 on every use, and only those
files of ``vendor/llama.cpp`` are extracted (the rest is llama.cpp's C++ source).

``python tests/llamacpp.py sdist`` (with the repository root on PYTHONPATH) prints the checked
sdist's path: ``make test-llamacpp`` builds llama-cpp-python from that same file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from demo.smollm2 import default_cache

VERSION = "0.3.36"
SDIST = f"llama-cpp-python=={VERSION}"
SDIST_FILE = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VENDOR = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
CONVERTER_FILES = ("convert_hf_to_gguf.py", "LICENSE", "conversion/", "gguf-py/")
STAMP = "extracted.json"

# Run with the vendored gguf-py first on the path: the GGUF's architecture, each tensor's name and
# storage type, and every tensor name that architecture defines (for blocks 0..n-1).
_READ_GGUF = """
import json, sys
import gguf
reader = gguf.GGUFReader(sys.argv[1])
def field(key):
    f = reader.fields[key]
    return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tolist()
arch = field("general.architecture")
blocks = int(field(f"{arch}.block_count"))
model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
names = set()
for t in gguf.MODEL_TENSORS[model_arch]:
    template = gguf.TENSOR_NAMES[t]
    names |= {template.format(bid=b) for b in range(blocks)} if "{bid}" in template else {template}
print(json.dumps({
    "architecture": arch,
    "tensors": {t.name: t.tensor_type.name for t in reader.tensors},
    "defined": sorted(n + ".weight" for n in names) + sorted(n + ".bias" for n in names),
}))
"""


def _cache_folder(cache: Path | None) -> Path:
    return (cache or default_cache()) / f"llama-cpp-python-{VERSION}"


def sdist(cache: Path | None = None) -> Path:
    """The pinned sdist, downloaded on first use (``pip download``, 77 MB) and checked."""
    path = _cache_folder(cache) / SDIST_FILE
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".download-") as tmp:
            command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
            command += ["--no-binary", ":all:", SDIST, "-d", tmp]
            subprocess.run(command, check=True)
            check_sdist(Path(tmp) / SDIST_FILE).rename(path)
    return check_sdist(path)


def check_sdist(path: Path) -> Path:
    """Refuse an sdist that is not the pinned one (a changed upload, a mirror's copy)."""
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(
            f"{path} has sha256 {digest}, not the pinned {SDIST_SHA256}: the registry's {SDIST} "
            "changed; delete the file, and pin the new hash only after checking it"
        )
    return path


def vendor(cache: Path | None = None) -> Path:
    """The converter's files of the sdist's ``vendor/llama.cpp``, extracted once."""
    folder = _cache_folder(cache) / "vendor-llama.cpp"
    if (folder / STAMP).is_file():
        return folder
    archive = sdist(cache)
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".extract-") as tmp:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if _wanted(m.name)]
            tar.extractall(tmp, members=members, filter="data")
        built = Path(tmp) / VENDOR
        stamp = {"sdist": SDIST, "sha256": SDIST_SHA256, "files": len(members)}
        (built / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        built.rename(folder)
    return folder


def _wanted(name: str) -> bool:
    if not name.startswith(VENDOR):
        return False
    inner = name[len(VENDOR) :]
    return any(inner == f or (f.endswith("/") and inner.startswith(f)) for f in CONVERTER_FILES)


def _vendored_env() -> dict[str, str]:
    llama = vendor()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(llama / "gguf-py"), str(llama)])
    return env


def convert(model: Path, outfile: Path, outtype: str) -> float:
    """``convert_hf_to_gguf.py model --outtype outtype --outfile outfile``; returns its seconds."""
    script = vendor() / "convert_hf_to_gguf.py"
    command = [sys.executable, str(script), str(model), "--outtype", outtype]
    command += ["--outfile", str(outfile)]
    start = time.perf_counter()
    done = subprocess.run(command, env=_vendored_env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model}:\n{done.stderr[-4000:]}")
    return time.perf_counter() - start


def read_gguf(path: Path) -> dict:
    """The GGUF's architecture, its tensors (name -> storage type) and every tensor name the
    architecture defines, as the vendored ``GGUFReader`` and tensor tables read them."""
    done = subprocess.run(
        [sys.executable, "-c", _READ_GGUF, str(path)],
        env=_vendored_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


if __name__ == "__main__":
    if sys.argv[1:] != ["sdist"]:
        raise SystemExit("usage: python tests/llamacpp.py sdist")
    try:
        print(sdist())
    except RuntimeError as err:
        raise SystemExit(str(err)) from None
