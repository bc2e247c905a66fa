"""How a model folder is identified: one scheme per purpose.

Which weights a surgery belongs to is :func:`weights_identity`, a fingerprint of the folder's
content. A cache of what was computed from a model (the capture store, the preflight's tokenizer
reads) is keyed by :func:`cache_key`, which trusts weight files' metadata instead of reading them.

A surgery module corrects the hidden states of the weights it was calibrated on and of no
others, so the manifest records ``merged_identity``, the :func:`weights_identity` of the merged
folder, and every loader compares it with the folder of the weights it is about to correct (the
sweep keys its cells by the same identity of the merge and of each target). It is taken from
content (``config.json`` and every weight file, sampled by
:func:`~mergekit_darts.core.correction.weights_fingerprint`), never from mtimes or inodes
as :func:`cache_key` is: a merged folder that is copied, downloaded or hardlinked keeps its
surgery, a merge redone with other weights does not. The model card, ``mergekit_config.yml``
(which calibration rewrites), tokenizer and generation files are no part of it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mergekit_darts.core.correction import weights_fingerprint
from mergekit_darts.manifest import RECIPE

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
CONFIG = "config.json"
INDEX_SUFFIX = ".index.json"  # model.safetensors.index.json, pytorch_model.bin.index.json


def _fingerprints(folder: str | Path) -> dict[str, str] | None:
    """File name -> fingerprint of ``config.json`` and each weight file of a model folder.

    None when ``folder`` holds no complete model (no config, no weights, or shards its index
    lists are missing, as in a Hub snapshot still downloading): there is nothing to compare.
    """
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        return None
    weights = sorted(
        path
        for path in folder.iterdir()
        if path.suffix in WEIGHT_SUFFIXES and not path.name.startswith(".") and path.is_file()
    )
    if not weights or _missing_shards(folder):
        return None
    found = {CONFIG: hashlib.sha256((folder / CONFIG).read_bytes()).hexdigest()}
    return found | {path.name: weights_fingerprint(path) for path in weights}


def weights_identity(folder: str | Path) -> str | None:
    """One sha256 for the model in ``folder`` (None: no complete model there)."""
    found = _fingerprints(folder)
    return None if found is None else hashlib.sha256(json.dumps(found).encode()).hexdigest()


def _missing_shards(folder: Path) -> bool:
    for index in folder.glob(f"*{INDEX_SUFFIX}"):
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # not an index this check can read: loading will say what is wrong
        if any(not (folder / str(shard)).is_file() for shard in shards):
            return True
    return False


def cache_key(ref: str) -> str:
    """A cheap key for what was computed from the model at ``ref`` (a local folder, or the Hub id
    itself): for caches only, never to decide which weights a surgery belongs to.

    Weight files count by (name, size, mtime_ns, ctime_ns, inode), the way make and ccache's
    direct mode trust file metadata, because hashing 14 GB of a 7B checkpoint would take longer
    than loading it; every other file (config, tokenizer, generation config) by content. A copy of
    the folder gets another key (its captures are recomputed), an edit in place a new mtime. The
    model card, the merge recipe (``mergekit_config.yml``), ``surgery/`` and hidden files are
    left out: writing a surgery into a merged folder (which records its block in the recipe) must
    not make its captures look stale.
    """
    folder = Path(ref)
    if not folder.is_dir():
        return "hub:" + ref  # disk entries need a local folder (see CaptureStore)
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.suffix == ".md" or path.name == RECIPE:
            continue  # not the model: the card and recipe are rewritten by surgery itself
        if not path.is_file():
            continue
        digest.update(path.name.encode() + b"\0")
        if path.suffix in WEIGHT_SUFFIXES:
            st = path.stat()
            digest.update(f"{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}".encode())
        else:
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        digest.update(b"\0")
    return "local:" + digest.hexdigest()
