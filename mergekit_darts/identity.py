"""How a model folder is identified: one scheme per purpose.

Which weights a surgery belongs to is :func:`weights_identity`, a fingerprint of the folder's
content. A cache of what was computed from a model (the capture store, the preflight's tokenizer
reads) is keyed by :func:`cache_key`, which trusts weight files' metadata instead of reading them.

A surgery module corrects the hidden states of the weights it was calibrated on and of no
others, so the manifest records ``merged_identity``, the :func:`weights_identity` of the merged
folder, and every loader compares it with the folder of the weights it is about to correct (the
sweep keys its cells by the same identity of the merge and of each target). It is taken from
content (``config.json`` and each weight file ``from_pretrained`` loads, sampled by
:func:`~mergekit_darts.core.correction.weights_fingerprint`), never from mtimes or inodes
as :func:`cache_key` is: a merged folder that is copied, downloaded or hardlinked keeps its
surgery, a merge redone with other weights does not. The model card, ``mergekit_config.yml``
(which calibration rewrites), tokenizer and generation files are no part of it, nor are weight
files transformers does not load (an earlier merge's shards that mergekit left beside a new
``model.safetensors``).
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
# what transformers' from_pretrained reads from a local folder, first found wins (after
# config.json's ``transformers_weights``): an earlier merge's shards that mergekit left beside a
# new model.safetensors are never loaded
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
LOAD_ORDER = (SAFETENSORS, SAFETENSORS_INDEX, "pytorch_model.bin", "pytorch_model.bin.index.json")
EXPLICIT_WEIGHTS = "transformers_weights"  # config.json's name for the file to load, if any


def _fingerprints(folder: str | Path) -> dict[str, str] | None:
    """File name -> fingerprint of ``config.json`` and each weight file a model folder loads.

    None when ``folder`` holds no complete model (no config, no weights, or shards its index
    lists are missing, as in a Hub snapshot still downloading): there is nothing to compare.
    """
    folder = Path(folder)
    if not (folder / CONFIG).is_file():
        return None
    weights = loaded_weight_files(folder)
    if not weights:
        return None
    found = {CONFIG: hashlib.sha256((folder / CONFIG).read_bytes()).hexdigest()}
    return found | {name: weights_fingerprint(folder / name) for name in weights}


def weights_identity(folder: str | Path) -> str | None:
    """One sha256 for the model in ``folder`` (None: no complete model there)."""
    found = _fingerprints(folder)
    return None if found is None else hashlib.sha256(json.dumps(found).encode()).hexdigest()


def weights_entry(folder: str | Path) -> str | None:
    """The weight file or index ``from_pretrained`` reads from ``folder``, by transformers' rule
    (``config.json``'s ``transformers_weights``, else the first of :data:`LOAD_ORDER` there);
    None when there is none of them."""
    folder = Path(folder)
    try:
        explicit = json.loads((folder / CONFIG).read_text(encoding="utf-8")).get(EXPLICIT_WEIGHTS)
    except (OSError, ValueError, AttributeError):
        explicit = None  # loading will say what is wrong with config.json
    if isinstance(explicit, str):
        return explicit
    return next((name for name in LOAD_ORDER if (folder / name).is_file()), None)


def loaded_weight_files(folder: str | Path) -> list[str] | None:
    """Names of the weight files ``from_pretrained`` loads from ``folder``, sorted: its
    :func:`weights_entry`, or the shards that index lists (None when one of them is missing);
    every weight file there when transformers' names are absent (e.g. a gguf-only folder)."""
    folder = Path(folder)
    entry = weights_entry(folder)
    if entry is None:
        return sorted(
            path.name
            for path in folder.iterdir()
            if path.suffix in WEIGHT_SUFFIXES and not path.name.startswith(".") and path.is_file()
        )
    if not entry.endswith(INDEX_SUFFIX):
        return [entry] if (folder / entry).is_file() else None
    try:
        shards = set(
            json.loads((folder / entry).read_text(encoding="utf-8"))["weight_map"].values()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # not an index this check can read: loading will say what is wrong
    if any(not (folder / str(shard)).is_file() for shard in shards):
        return None
    return sorted(map(str, shards))


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
