"""How a model folder is identified: one scheme per purpose.

Which weights a surgery belongs to is :func:`weights_identity`, a fingerprint of the folder's
content. A cache of what was computed from a model (the capture store, the preflight's tokenizer
reads) is keyed by :func:`cache_key`, which trusts weight files' metadata instead of reading them.

A surgery module corrects the hidden states of the weights it was calibrated on and of no
others, so the manifest records ``merged_identity``, the :func:`weights_identity` of the merged
folder, and every loader compares it with the folder of the weights it is about to correct (the
sweep keys its cells by the same identity of the merge and of each target). It is taken from
content (``config.json`` and each weight file ``from_pretrained`` loads, sampled by
:func:`~mergekit_darts.correction.darts_correction.weights_fingerprint`), never from mtimes or inodes
as :func:`cache_key` is: a merged folder that is copied, downloaded or hardlinked keeps its
surgery, a merge redone with other weights does not. The model card, ``mergekit_config.yml``
(which calibration rewrites), tokenizer and generation files are no part of it, nor are weight
files transformers does not load (an earlier merge's shards that mergekit left beside a new
``model.safetensors``).

Which files a load reads is one rule here (:func:`loaded_weight_files`, after transformers'
own precedence), and every other reader calls it: the identity, the store's key, and the refusal
of a merged folder that holds two merges (:func:`check_one_merge`; mergekit never removes what an
earlier merge into the same folder wrote, so shards and a single file can lie side by side).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from mergekit_darts.correction.darts_correction import weights_fingerprint
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.folder.manifest import RECIPE

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


def is_weight_file(path: Path) -> bool:
    """Whether ``path`` holds weights or a shard index by its name (hidden files never)."""
    name = path.name
    return not name.startswith(".") and (
        path.suffix in WEIGHT_SUFFIXES or name.endswith(INDEX_SUFFIX)
    )


def unread_weight_files(folder: str | Path) -> list[str]:
    """Weight files and indexes in ``folder`` that ``from_pretrained`` does not read, entry files
    first; none when what it reads cannot be told (a listed shard missing: the load fails)."""
    folder = Path(folder)
    loaded = loaded_weight_files(folder)
    if loaded is None:
        return []
    read = {*loaded, weights_entry(folder)}
    return _entries_first(
        p.name for p in folder.iterdir() if is_weight_file(p) and p.is_file() and p.name not in read
    )


Stats = Mapping[str, tuple[int, int, int, int]]


def weight_file_stats(folder: str | Path) -> dict[str, tuple[int, int, int, int]]:
    """Name -> (size, mtime_ns, ctime_ns, inode) of each weight file in ``folder``: taken before
    a merge, it tells the files the merge wrote (new or rewritten) from those it left alone."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    return {p.name: _stat(p) for p in folder.iterdir() if is_weight_file(p) and p.is_file()}


def _stat(path: Path) -> tuple[int, int, int, int]:
    """(size, mtime_ns, ctime_ns, inode): what a rewrite, an edit in place or a copy changes."""
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def check_one_merge(folder: str | Path, before: Stats | None = None) -> None:
    """Refuse a merged ``folder`` whose weight files are not all one merge's, before anything is
    calibrated on it (the reason: :func:`two_merges`)."""
    problem = two_merges(folder, before)
    if problem is not None:
        raise SurgeryConfigError(problem)


def two_merges(folder: str | Path, before: Stats | None = None) -> str | None:
    """Why ``folder`` holds the weights of two merges, in one line; None when it does not.

    ``before`` (:func:`weight_file_stats` taken before a merge into ``folder``) names the files
    that merge left untouched: an earlier merge's. Without it the folder cannot say which merge is
    newer, only that it holds weight files the load does not read.
    """
    folder = Path(folder)
    fix = "or merge into an empty folder"
    if before is None:
        unread = unread_weight_files(folder)
        if not unread:
            return None
        return (
            f"{folder} holds two merges: transformers loads {weights_entry(folder)}, and "
            f"{_names(unread)} beside it {'is' if len(unread) == 1 else 'are'} another merge's, "
            f"never loaded (nothing says which is newer): remove the earlier merge's files, {fix}"
        )
    now = weight_file_stats(folder)
    stale = _entries_first(name for name, st in now.items() if before.get(name) == st)
    if not stale:
        return None
    read = {weights_entry(folder), *(loaded_weight_files(folder) or [])}
    instead = " and which transformers loads instead of the new weights" * bool(read & {*stale})
    return (
        f"{folder} still holds {_names(stale)} from an earlier merge, which this merge did not "
        f"write{instead}: remove {'it' if len(stale) == 1 else 'them'}, {fix}"
    )


def _entries_first(names: Iterable[str]) -> list[str]:
    """Sorted, the files transformers looks for first (an index before its shards)."""
    return sorted(names, key=lambda name: (name not in LOAD_ORDER, name))


def _names(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 2 more``: a list a one-line message can hold."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


def cache_key(ref: str) -> str:
    """A cheap key for what was computed from the model at ``ref`` (a local folder, or the Hub id
    itself): for caches only, never to decide which weights a surgery belongs to.

    Weight files count by (name, size, mtime_ns, ctime_ns, inode), the way make and ccache's
    direct mode trust file metadata, because hashing 14 GB of a 7B checkpoint would take longer
    than loading it; every other file (config, tokenizer, generation config) by content. A copy of
    the folder gets another key (its captures are recomputed), an edit in place a new mtime. The
    model card, the merge recipe (``mergekit_config.yml``), ``surgery/`` and hidden files are
    left out: writing a surgery into a merged folder (which records its block in the recipe) must
    not make its captures look stale. So are the weight files and indexes the load does not read
    (:func:`unread_weight_files`): removing an earlier save's leftover shards changes no capture.
    """
    folder = Path(ref)
    if not folder.is_dir():
        return "hub:" + ref  # disk entries need a local folder (see CaptureStore)
    unread = set(unread_weight_files(folder))
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.suffix == ".md" or path.name == RECIPE:
            continue  # not the model: the card and recipe are rewritten by surgery itself
        if not path.is_file() or path.name in unread:
            continue
        digest.update(path.name.encode() + b"\0")
        if path.suffix in WEIGHT_SUFFIXES:
            digest.update(":".join(map(str, _stat(path))).encode())
        else:
            digest.update(hashlib.sha256(path.read_bytes()).digest())
        digest.update(b"\0")
    return "local:" + digest.hexdigest()
