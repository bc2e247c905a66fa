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
import yaml
from safetensors.torch import save

from mergekit_darts.artifacts import (
    check_calibrated_on,
    load_joint,
    load_routed,
    load_surgery,
    read_manifest,
    resolve_task,
)
from mergekit_darts.core import correction
from mergekit_darts.deploy import LINKS, modeling_darts, plain
from mergekit_darts.deploy.modeling_darts import (
    CORRECTION_FILE,
    MODEL_TYPE,
    SURGERY_FILE,
    TENSOR_PREFIX,
    export_config,
    weights_fingerprint,
)
from mergekit_darts.errors import ExportError
from mergekit_darts.fs import inside, staged_folder
from mergekit_darts.identity import (
    SAFETENSORS,
    SAFETENSORS_INDEX,
    WEIGHT_SUFFIXES,
    weights_entry,
)
from mergekit_darts.integrations.card import RHO_L1_NOTE, TAGS, joint_rows
from mergekit_darts.manifest import RECIPE, surgery_dir
from mergekit_darts.task_map import JOINT, ROUTED

MODELING_FILE = Path(modeling_darts.__file__)
# the shipped file, and the correction it imports relatively under the name it imports
SHIPPED_FILES = {MODELING_FILE.name: MODELING_FILE, CORRECTION_FILE: Path(correction.__file__)}
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
    (folder / "README.md").write_text(model_card(source, task, shown), encoding="utf-8")


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
    """A plain folder: the merge with ``module`` folded into its own tensors (deploy.plain)."""
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
    (folder / "README.md").write_text(model_card(source, task, shown), encoding="utf-8")


def _place(src: Path, dst: Path, link: str) -> None:
    if link == "symlink":
        os.symlink(src.resolve(), dst)
    elif link == "hardlink":
        os.link(src.resolve(), dst)
    else:
        shutil.copyfile(src, dst)


# ---- model card -------------------------------------------------------------------------------------


def model_card(source: _Source, task: str, name: str) -> str:
    """Markdown for DEST/README.md: where it comes from, what it corrects, how to use it."""
    _, _, models = _merge_config(source.out)
    hub_models = [m for m in models if _looks_like_hub_id(m)]
    front = {
        "library_name": "transformers",
        "tags": [*TAGS, "mergekit", "merge"],
        **({"base_model": hub_models} if hub_models else {}),
    }
    if task == JOINT:
        return _joint_card(source, name, front)
    if task != ROUTED and source.manifest.tasks[task].module in correction.PLAIN_KINDS:
        return _plain_card(source, task, name, front)
    names, intro, extra = _module_intro(source, task)
    eval_tasks = [t for n in names for t in source.manifest.tasks[n].eval_tasks]
    lm_eval_tasks = ",".join(dict.fromkeys(eval_tasks)) or "TASKS"
    rows = []
    for n in names:
        entry = source.manifest.tasks[n]
        rho = entry.metrics.get("rho_l1")  # absent in hand-made surgery folders
        rows.append(
            f"| `{n}` | `{entry.target or ''}` | {', '.join(entry.eval_tasks)} | {entry.module} | "
            f"{entry.loss or ''} | {entry.rank} | {entry.max_positions} | "
            f"{'—' if rho is None else f'{rho:.3f}'} |"
        )
    lines = [
        *_heading(front, name),
        intro,
        "",
        "| task | target | lm-eval tasks | module | loss | rank | max positions | ρ_L1 |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *(extra + [""] if extra else []),
        RHO_L1_NOTE,
        "",
        "## Load",
        "",
        "`trust_remote_code=True` is required: the folder's model type is `darts`, and without the "
        "shipped code the model would load without its correction. Only torch and transformers "
        "are needed (not mergekit-darts).",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)',
        f'tokenizer = AutoTokenizer.from_pretrained("{name}", trust_remote_code=True)',
        "```",
        "",
        "(The tokenizer is the merge's own; the flag only spares AutoTokenizer a prompt about "
        "the folder's custom config.)",
        "",
        "## Serve",
        "",
        "```sh",
        'pip install "mergekit-darts[vllm]"   # the vLLM plugin that applies the correction',
        f"vllm serve {name}",
        "```",
        "",
        "## Evaluate",
        "",
        "```sh",
        f"lm_eval --model hf --model_args pretrained={name},trust_remote_code=True "
        f"--tasks {lm_eval_tasks}",
        f"lm_eval --model vllm --model_args pretrained={name} --tasks {lm_eval_tasks}",
        "```",
    ]
    return "\n".join(lines + _source_lines(source.out)) + "\n"


def _module_intro(source: _Source, task: str) -> tuple[list[str], str, list[str]]:
    """A module export's tasks, its opening paragraph and any extra lines: one task's module, or
    every routed task's behind the router."""
    arch = source.config["architectures"][0]
    if task == ROUTED:
        router = source.manifest.router
        names = list(router.tasks)
        intro = (
            f"The merged model `{source.out.name}` with the DARTS surgery modules of tasks "
            f"{', '.join(f'`{n}`' for n in names)} behind one router: per token, a gate "
            "`softmax(W h + b)` on the final hidden state `h` (the LM head's input) weighs the "
            "tasks' float32 corrections"
            + (", plus a last class for text that needs none" if router.background else "")
            + ", so each domain gets its correction without being told which domain it is. "
            "Applied at every forward call by the shipped `modeling_darts.py`, which builds on "
            f"transformers' own `{arch}`."
        )
        accuracy = (router.held_out or {}).get("token_accuracy")
        extra = (
            [f"Router: classes {', '.join(router.classes)}"
             + ("" if accuracy is None else f"; held-out token accuracy {accuracy:.3f}") + "."]
        )  # fmt: skip
        return names, intro, extra
    module = source.manifest.tasks[task].module
    intro = (
        f"The merged model `{source.out.name}` with the DARTS surgery module of task `{task}`: "
        "a small float32 correction of the final hidden state (the LM head's input), applied "
        "at every forward call by the shipped `modeling_darts.py`, which builds on "
        f"transformers' own `{arch}`."
    )
    none = ["Its module is `none`: the correction is the identity (the plain merge)."]
    return [task], intro, none if module == "none" else []


def _heading(front: dict[str, Any], name: str) -> list[str]:
    """The card's YAML front matter and title."""
    return ["---", yaml.safe_dump(front, sort_keys=False).rstrip("\n"), "---", f"# {name}", ""]


def _source_lines(out: Path) -> list[str]:
    """The card's "Source merge" section: the models and the merge YAML, when recorded."""
    merge_yaml, base, models = _merge_config(out)
    if not merge_yaml:
        return []
    lines = ["", "## Source merge", ""]
    lines += [f"- `{m}`" + (" (base)" if i == 0 and base else "") for i, m in enumerate(models)]
    return lines + ["", "```yaml", merge_yaml.rstrip("\n"), "```"]


def _plain_card(source: _Source, task: str, name: str, front: dict[str, Any]) -> str:
    """The card of a plain export: an ordinary checkpoint of the merge's architecture."""
    entry = source.manifest.tasks[task]
    lines = [
        *_heading(front, name),
        f"The merged model `{source.out.name}` with the DARTS plain correction of task `{task}` "
        f"(module `{entry.module}`) {_folded(source, entry.module)}",
        "",
        *_plain_usage(name, entry.eval_tasks),
    ]
    return "\n".join(lines + _source_lines(source.out)) + "\n"


def _joint_card(source: _Source, name: str, front: dict[str, Any]) -> str:
    """The card of the joint export: one plain checkpoint for every task, and each task's
    verdict."""
    entry = source.manifest.joint
    names = ", ".join(f"`{t}`" for t in entry.tasks)
    selection = entry.selection
    if entry.module == "none":
        intro = (
            f"The merged model `{source.out.name}` as it is: the verdict kept no joint correction "
            f"of tasks {names}, so this folder is the merge, an ordinary checkpoint."
        )
    else:
        intro = (
            f"The merged model `{source.out.name}` with the DARTS joint plain correction of tasks "
            f"{names} (module `{entry.module}`, fitted on every task's prompts at once: one model "
            f"for every task, no task id) {_folded(source, entry.module)}"
        )
    eval_tasks = [t for n in entry.tasks for t in source.manifest.tasks[n].served(n)]
    lines = [
        *_heading(front, name),
        intro,
        "",
        f"Verdict: {selection.get('verdict', '')}",
        "",
        *joint_rows(selection),
        "",
        *_plain_usage(name, list(dict.fromkeys(eval_tasks))),
    ]
    return "\n".join(lines + _source_lines(source.out)) + "\n"


def _folded(source: _Source, kind: str) -> str:
    """Where a plain kind lives in the checkpoint, and what that means for serving it."""
    arch = source.config["architectures"][0]
    where = (
        "folded into the LM head (`W (I - M)`; no bias is added: a head without one gets none, "
        "and a head bias, as Phi's, is kept exactly)"
        if kind == "head"
        else "folded into the final norm's weight (a per-channel scale; a LayerNorm's bias, as "
        "Phi's, is scaled with it)"
    )
    untied = (
        " The merge ties its LM head to the input embedding; this folder unties it into its own "
        "`lm_head.weight` (`tie_word_embeddings: false`), which adds vocabulary x hidden "
        "parameters."
        if kind == "head" and source.config.get("tie_word_embeddings")
        else ""
    )
    return (
        f"{where}. It is an ordinary `{arch}` checkpoint: no custom code, no extra tensors, so it "
        "serves in any engine (stock transformers, vLLM, llama.cpp / GGUF, SGLang, TGI) exactly "
        f"as the merge does.{untied}"
    )


def _plain_usage(name: str, eval_tasks: list[str]) -> list[str]:
    tasks = ",".join(eval_tasks) or "TASKS"
    return [
        "## Load, serve, evaluate",
        "",
        "```sh",
        f'python -c "from transformers import AutoModelForCausalLM; '
        f"AutoModelForCausalLM.from_pretrained('{name}')\"",
        f"vllm serve {name}",
        f"python convert_hf_to_gguf.py {name}   # llama.cpp",
        f"lm_eval --model hf --model_args pretrained={name} --tasks {tasks}",
        "```",
    ]


def _merge_config(out: Path) -> tuple[str | None, bool, list[str]]:
    """The merge YAML mergekit left in the folder, whether it has a base model, and the models it
    names (base model first)."""
    file = out / RECIPE
    if not file.is_file():
        return None, False, []
    text = file.read_text(encoding="utf-8")
    try:
        from mergekit.config import MergeConfiguration

        config = MergeConfiguration.model_validate(yaml.safe_load(text))
    except Exception:  # an unreadable record only costs the card its model list
        return text, False, []
    base = [str(config.base_model.model.path)] if config.base_model else []
    others = sorted({str(m.model.path) for m in config.referenced_models()} - set(base))
    return text, bool(base), base + others


def _looks_like_hub_id(path: str) -> bool:
    """``org/name`` that is not a local folder (mergekit's own test asks the Hub, offline here)."""
    return path.count("/") == 1 and path[0] not in "./~" and not Path(path).exists()
