"""``mergekit-darts export``: a merged folder + one surgery task (or, with ``--routed``, every
routed task's module and the router) -> a Hugging Face model folder.

The result loads with ``AutoModelForCausalLM.from_pretrained(DEST, trust_remote_code=True)``
where mergekit-darts is not installed: ``config.json`` gets a model_type of its own (``darts``, so
loading without ``trust_remote_code`` fails instead of silently dropping the correction) and an
``auto_map`` to the shipped ``modeling_darts.py``; the surgery tensors sit in their own file that
the weight index lists next to the merged shards. The vLLM plugin reads the same layout
(docs/deploy.md).

The format (``config.json``'s ``darts`` section, file and tensor names, ``auto_map``) is defined
by the shipped file itself, which checks it again on load. Every input is checked before anything
is written; the folder is built under a temporary name next to DEST and renamed into place
(``fs.staged_folder``), so a failed export leaves nothing behind.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save

from mergekit_darts.correction import darts_correction, modeling_darts
from mergekit_darts.correction.modeling_darts import (
    MODEL_TYPE,
    SURGERY_FILE,
    TENSOR_PREFIX,
    export_config,
    weights_fingerprint,
)
from mergekit_darts.errors import ExportError
from mergekit_darts.folder.artifacts import (
    check_calibrated_on,
    load_joint,
    load_routed,
    load_surgery,
    read_manifest,
    resolve_task,
)
from mergekit_darts.folder.fs import inside, staged_folder
from mergekit_darts.folder.identity import (
    SAFETENSORS,
    SAFETENSORS_INDEX,
    WEIGHT_SUFFIXES,
    weights_entry,
)
from mergekit_darts.folder.manifest import surgery_dir
from mergekit_darts.hosts.deploy import LINKS, plain
from mergekit_darts.present.card import export_card
from mergekit_darts.task_map import JOINT, ROUTED

# the two files every export ships, under their own names: modeling_darts.py imports its
# neighbour darts_correction.py relatively, in this package and in an exported folder alike
SHIPPED_FILES = {
    Path(m.__file__).name: Path(m.__file__) for m in (modeling_darts, darts_correction)
}
MODELING_FILE = Path(modeling_darts.__file__)
INDEX, SINGLE = SAFETENSORS_INDEX, SAFETENSORS
# transformers prefers model.safetensors over the index, which would skip the surgery tensors:
# a single-file merge is therefore exported under a shard name the index points to.
SINGLE_AS_SHARD = "model-00001-of-00001.safetensors"
_NOT_COPIED = {"config.json", "README.md", INDEX}


def export(
    out_path: str | Path,
    dest: str | Path,
    task: str | None = None,
    *,
    all_tasks: bool = False,
    routed: bool = False,
    joint: bool = False,
    link: str = "symlink",
) -> list[Path]:
    """Export ``task`` (or with ``all_tasks`` every task, as ``DEST/<task>/``; with ``routed``
    every routed task's module and the router, in one folder; with ``joint`` the joint plain
    correction of every task, as a plain folder) of the merged folder ``out_path``; returns the
    folders written."""
    if (task is not None) + all_tasks + routed + joint != 1:
        raise ExportError("pass either --task NAME, --all, --routed or --joint")
    if link not in LINKS:
        raise ExportError(f"unknown --link {link!r}; choose one of {', '.join(LINKS)}")
    out, dest = Path(out_path), Path(os.path.abspath(dest))  # abspath: "." and "x/" have names
    if inside(dest, out):
        raise ExportError(
            f"{dest} is inside the merged folder {out}, which calibration rewrites (`calibrate "
            "--overwrite` replaces surgery/): choose a DEST outside it"
        )
    source = _Source.read(out)
    if routed:  # loaded before DEST is checked: a folder without a usable router stops here
        modules: dict[str, Any] = {ROUTED: load_routed(source.surgery, weights=out)}
        tasks = [ROUTED]
    elif joint:  # likewise: a folder without a joint correction stops here
        modules = {JOINT: load_joint(source.surgery, weights=out)}
        tasks = [JOINT]
    elif all_tasks:
        tasks = list(source.manifest.tasks)
    else:
        tasks = [resolve_task(source.manifest, task, source.surgery)]
    _check_dest(dest)
    if link == "hardlink":
        _check_same_filesystem(source, dest)
    if not (routed or joint):
        modules = {name: load_surgery(source.surgery, name) for name in tasks}

    try:
        with staged_folder(dest, replace=False) as staging:
            for name, module in modules.items():
                folder = staging / name if all_tasks else staging
                folder.mkdir(exist_ok=True)
                shown = f"{dest.name}/{name}" if all_tasks else dest.name
                if joint or getattr(module, "plain", False):
                    _write_plain(folder, source, name, module, link, shown)
                else:
                    _write_folder(folder, source, name, module.state_dict(), link, shown)
    except OSError as err:  # the staging folder is gone: DEST is as it was
        raise ExportError(_write_failed(dest, err)) from err
    return [dest / name for name in tasks] if all_tasks else [dest]


def _write_failed(dest: Path, err: OSError) -> str:
    """One line for a write that failed (a full disk, a quota, permissions) while staging DEST."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        cause = f"no space left on the device of {dest.parent} (a full disk or quota)"
        fix = "free some space or choose a DEST elsewhere (--link symlink needs the least)"
    else:
        cause = f"writing failed: {err.strerror or err}" + (
            f" ({err.filename})" if err.filename else ""
        )
        fix = "fix that and run the export again"
    return f"could not export to {dest}: {cause}; nothing was written, {fix}"


# ---- checks -----------------------------------------------------------------------------------------


class _Source:
    """The merged folder as far as the export needs it: config, weights, surgery manifest."""

    def __init__(self, out: Path, config: dict[str, Any], weight_map: dict[str, str]):
        self.out, self.config, self.weight_map = out, config, weight_map
        self.surgery = surgery_dir(out)
        self.manifest = read_manifest(self.surgery)
        check_calibrated_on(self.manifest, self.surgery, out)
        # what the shipped file checks on load: a linked export follows its merge's files
        self.fingerprints = {s: weights_fingerprint(out / s) for s in self.shards()}

    @classmethod
    def read(cls, out: Path) -> _Source:
        if not out.is_dir():
            raise ExportError(f"{out} is not a folder: pass the merged model folder")
        try:
            config = json.loads((out / "config.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ExportError(f"{out} has no config.json: pass a merged model folder") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ExportError(f"{out / 'config.json'} is not valid JSON ({err})") from err
        model_type, architectures = config.get("model_type"), config.get("architectures")
        if model_type == MODEL_TYPE:
            raise ExportError(
                f"{out} is already a DARTS export: pass the merged folder it came from"
            )
        if not model_type or not architectures:
            raise ExportError(f"{out / 'config.json'} names no model_type and architectures")
        if "auto_map" in config or not hasattr(transformers, architectures[0]):
            raise ExportError(
                f"{out} is a {architectures[0]} from custom code; export supports the decoders "
                "transformers itself ships (the exported folder builds on transformers' class)"
            )
        if not surgery_dir(out).is_dir():
            raise ExportError(
                f"{out} has no surgery/ folder: run `mergekit-darts calibrate {out} SURGERY_YML` "
                "(or merge with a surgery: block) first"
            )
        source = cls(out, config, _weight_map(out))
        hidden = config.get("hidden_size")
        if hidden is not None and hidden != source.manifest.hidden_size:
            raise ExportError(
                f"{out}/surgery was made for hidden size {source.manifest.hidden_size}, "
                f"but config.json has {hidden}: re-run the surgery on this merge"
            )
        return source

    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def _weight_map(out: Path) -> dict[str, str]:
    """tensor name -> file, from the index or from the single file's header (safetensors only):
    the one transformers loads (:func:`weights_entry`), never stale files lying beside it."""
    entry = weights_entry(out)
    if entry == INDEX:
        try:
            weight_map = json.loads((out / INDEX).read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ExportError(f"{out / INDEX} is not a safetensors index ({err})") from err
        missing = sorted({f for f in weight_map.values() if not (out / f).is_file()})
        if missing:
            raise ExportError(f"{out / INDEX} lists missing files: {', '.join(missing)}")
    elif entry == SINGLE:
        weight_map = dict.fromkeys(_tensor_bytes(out / SINGLE), SINGLE)
    else:
        found = f"has no {SINGLE} or {INDEX}"
        if entry is not None:
            found = f"loads its weights from {entry}, not {SINGLE} or {INDEX}"
        raise ExportError(
            f"{out} {found}: export reads safetensors weights only "
            "(re-run the merge with mergekit's default --safe-serialization)"
        )
    clash = [name for name in weight_map if name.startswith(TENSOR_PREFIX)]
    if clash:
        raise ExportError(f"{out} already has tensors named {TENSOR_PREFIX}*: {clash[0]}")
    return weight_map


def _tensor_bytes(file: Path) -> dict[str, int]:
    """Tensor name -> size in bytes, from a safetensors header (the data is never read)."""
    try:
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        return {
            name: info["data_offsets"][1] - info["data_offsets"][0]
            for name, info in header.items()
            if name != "__metadata__"
        }
    except (OSError, struct.error, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ExportError(f"{file} is not a readable safetensors file ({err})") from err


def _check_dest(dest: Path) -> None:
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise ExportError(f"{dest} exists and is not a folder: choose a new DEST")
    if dest.is_dir() and any(dest.iterdir()):
        raise ExportError(f"{dest} exists and is not empty: choose a new DEST or empty it")


def _check_same_filesystem(source: _Source, dest: Path) -> None:
    parent = next(p for p in [dest, *dest.absolute().parents] if p.exists())
    if os.stat(source.out / source.shards()[0]).st_dev != os.stat(parent).st_dev:
        raise ExportError(
            f"--link hardlink needs {source.out} and {dest} on one filesystem; "
            "use --link copy (or symlink) instead"
        )


# ---- writing ----------------------------------------------------------------------------------------


def _write_folder(
    folder: Path,
    source: _Source,
    task: str,
    state: Mapping[str, torch.Tensor],
    link: str,
    shown: str,
) -> None:
    """One exported folder; ``shown`` is its name in the model card's commands."""
    renamed = {SINGLE: SINGLE_AS_SHARD}
    for shard in source.shards():
        _place(source.out / shard, folder / renamed.get(shard, shard), link)
    _copy_side_files(source, folder)
    tensors = {
        TENSOR_PREFIX + k: v.detach().to("cpu", torch.float32).contiguous()
        for k, v in state.items()
    }
    weight_map = {name: renamed.get(file, file) for name, file in source.weight_map.items()}
    if tensors:  # a `none` module has no tensors: no surgery file, the index lists the merge's
        # bytes through a plain write: safetensors' save_file would make the file 0600
        (folder / SURGERY_FILE).write_bytes(save(tensors, metadata={"format": "pt"}))
        weight_map |= dict.fromkeys(sorted(tensors), SURGERY_FILE)
    total = sum(sum(_tensor_bytes(folder / f).values()) for f in sorted(set(weight_map.values())))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    weights = {renamed.get(s, s): source.fingerprints[s] for s in source.shards()}
    if tensors:  # bound like the weights: a surgery file swapped in from another export is refused
        weights[SURGERY_FILE] = weights_fingerprint(folder / SURGERY_FILE)
    hidden_size = source.manifest.hidden_size
    if task == ROUTED:
        router = source.manifest.router
        entries = [(name, source.manifest.tasks[name]) for name in router.tasks]
        routed = {
            "tasks": [{"name": n, **e.module_fields()} for n, e in entries],
            "background": router.background,
        }
        config = export_config(
            source.config, hidden_size=hidden_size, routed=routed, weights=weights
        )
    else:
        config = export_config(
            source.config,
            task=task,
            **source.manifest.tasks[task].module_fields(),
            hidden_size=hidden_size,
            weights=weights,
        )
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name, file in SHIPPED_FILES.items():
        shutil.copyfile(file, folder / name)
    (folder / "README.md").write_text(
        export_card(source.out, source.config, source.manifest, task, shown), encoding="utf-8"
    )


def _copy_side_files(source: _Source, folder: Path) -> None:
    """The merge's files other than weights, its config and its card (tokenizer and the like)."""
    for file in sorted(source.out.iterdir()):
        if (
            file.is_file()
            and not file.name.startswith(".")
            and file.name not in _NOT_COPIED
            and file.suffix not in WEIGHT_SUFFIXES
        ):
            shutil.copyfile(file, folder / file.name)


def _write_plain(
    folder: Path, source: _Source, task: str, module: Any, link: str, shown: str
) -> None:
    """A plain folder: the merge with ``module`` folded into its own tensors (hosts.deploy.plain)."""
    plain.check_plain_kind(module.kind, source.config.get("model_type"), "export")
    where = plain.layout(source.out, source.weight_map)
    folded = plain.folded_tensors(source.out, source.weight_map, module, where)
    weight_map, written = plain.write_shards(
        source.out, folder, source.weight_map, folded, where.head
    )
    for shard in source.shards():
        if shard not in written:
            _place(source.out / shard, folder / shard, link)
    _copy_side_files(source, folder)
    if INDEX in {p.name for p in source.out.iterdir()} or len(source.shards()) > 1:
        total = sum(
            sum(_tensor_bytes(folder / f).values()) for f in sorted(set(weight_map.values()))
        )
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config = plain.plain_config(source.config, where, module.kind)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (folder / "README.md").write_text(
        export_card(source.out, source.config, source.manifest, task, shown), encoding="utf-8"
    )


def _place(src: Path, dst: Path, link: str) -> None:
    if link == "symlink":
        os.symlink(src.resolve(), dst)
    elif link == "hardlink":
        os.link(src.resolve(), dst)
    else:
        shutil.copyfile(src, dst)
