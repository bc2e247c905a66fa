"""The on-disk form of surgery: ``surgery/<task>.safetensors`` plus ``surgery/manifest.json``.

Everything is validated on load with a one-line error, because a surgery folder travels with a
merged checkpoint and may meet a model, or a version of this package, it was not made for.
The folder is written under a temporary name and renamed into place (``fs.staged_folder``), so
readers never see half of it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from mergekit_darts.correction.darts_correction import (
    RoutedSurgery,
    Router,
    SurgeryModule,
    correction_module,
    load_state,
    state_shapes,
)
from mergekit_darts.errors import SurgeryFormatError
from mergekit_darts.folder.fs import staged_folder
from mergekit_darts.folder.identity import weights_identity
from mergekit_darts.folder.manifest import (
    FORMAT,
    JOINT_FILE,
    MANIFEST,
    ROUTER,
    SURGERY_YAML,
    Manifest,
    module_file,
    relative_file_name,
)
from mergekit_darts.task_map import JOINT, ROUTED


def expected_shapes(kind: str, hidden_size: int, rank: int, max_positions: int) -> dict[str, tuple]:
    """Tensor names and shapes of a module, from a fresh instance (one source of truth)."""
    with torch.device("meta"):
        return state_shapes(correction_module(kind, hidden_size, rank, max_positions).state_dict())


def read_manifest(folder: str | Path) -> Manifest:
    """Read and check ``manifest.json``: format, version, and the types of what code reads."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise SurgeryFormatError(
            f"no surgery manifest at {path}: point surgery_path at a folder written by mergekit-darts"
        )
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise SurgeryFormatError(f"{path} is not valid JSON ({err}); re-run the surgery") from err
    if not isinstance(manifest, dict) or "format" not in manifest:  # its value: Manifest's
        raise SurgeryFormatError(f"{path} is not a {FORMAT!r} manifest")
    if not isinstance(manifest.get("tasks"), dict) or not manifest["tasks"]:
        raise SurgeryFormatError(f"{path} lists no surgery tasks")
    return Manifest.from_dict(manifest, where=str(path))


def resolve_task(manifest: Manifest, task: str | None, folder: Path) -> str:
    """The task to load: the one asked for, or the only one there is."""
    names = list(manifest.tasks)
    if task is None:
        if len(names) == 1:
            return names[0]
        raise SurgeryFormatError(
            f"{folder} holds several surgery tasks ({', '.join(names)}): choose one"
        )
    if task not in manifest.tasks:
        raise SurgeryFormatError(
            f"no surgery task {task!r} in {folder}; available: {', '.join(names)}"
        )
    return task


def check_calibrated_on(manifest: Manifest, folder: Path, weights: str | Path | None) -> None:
    """Refuse the ``surgery/`` ``folder`` when the weights it would correct are not those it was
    calibrated on.

    ``weights`` is the folder of the model the modules will correct (default: the model folder
    around ``folder``). Nothing to compare passes: a manifest that records no identity (written
    before it was recorded, or by hand), or no complete local model folder (a surgery folder kept
    outside one, a Hub model not downloaded yet).
    """
    if manifest.merged_identity is None:
        return
    model = Path(weights) if weights is not None else folder.parent
    found = weights_identity(model)
    if found is None or found == manifest.merged_identity:
        return
    raise SurgeryFormatError(
        f"{folder} was calibrated on other weights than those in {model} (the merge was redone "
        f"or changed since): re-run `mergekit-darts calibrate {model} {folder / SURGERY_YAML} "
        "--overwrite` (or restore the weights it was made for)"
    )


def load_surgery(
    folder: str | Path, task: str | None = None, *, weights: str | Path | None = None
) -> SurgeryModule:
    """Load the module of ``task`` from a ``surgery/`` folder, checking shapes against the manifest
    and the weights it will correct (``weights``, default the model folder around it) against
    those it was calibrated on (:func:`check_calibrated_on`)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    task = resolve_task(manifest, task, folder)
    check_calibrated_on(manifest, folder, weights)
    return _load_module(folder, manifest, task)


def _load_module(folder: Path, manifest: Manifest, task: str) -> SurgeryModule:
    """One task's module from its file, checked against the manifest entry."""
    entry = manifest.tasks[task]
    kind, rank, max_positions = entry.module, entry.rank, entry.max_positions
    hidden_size = manifest.hidden_size
    if entry.file is None:
        raise SurgeryFormatError(f"manifest entry of task {task!r} names no file")
    described = (
        f"a {kind} module with hidden_size={hidden_size}, rank={rank}, "
        f"max_positions={max_positions}"
    )

    def build() -> SurgeryModule:
        try:
            return correction_module(kind, hidden_size, rank, max_positions)
        except ValueError as err:
            raise SurgeryFormatError(f"manifest entry of task {task!r}: {err}") from err

    owner = f"task {task!r}"
    return _load_bound(build, folder, entry.file, entry.sha256, owner, described).eval()


def _load_bound(
    build: Callable[[], Any],
    folder: Path,
    name: str,
    sha256: str | None,
    owner: str,
    described: str,
) -> Any:
    """``build()`` loaded (as float32) from ``folder/name``, the file the manifest lists for
    ``owner`` (a task, the router); else one line saying what is wrong.

    Every loader reads surgery tensors through here. The tensors' names and shapes must be
    exactly those ``described`` needs, taken from a build on the meta device (a hand-edited size,
    a huge rank, is refused, never allocated). The file's bytes must have the ``sha256`` the
    manifest recorded: two modules of one shape (two tasks', one task's from two runs) differ
    only in their numbers. None (a manifest written before it was recorded, or by hand) is
    accepted unchecked, as ``merged_identity`` is.
    """
    file = folder / name
    try:
        data = file.read_bytes()
    except OSError as err:
        raise SurgeryFormatError(
            f"surgery file {file} of {owner} is missing or unreadable ({err.strerror})"
        ) from err
    try:
        tensors = load(data)
    except SafetensorError as err:
        raise SurgeryFormatError(f"{file} is not a readable safetensors file ({err})") from err
    with torch.device("meta"):
        expected = state_shapes(build().state_dict())
    found = state_shapes(tensors)
    if found != expected:
        raise SurgeryFormatError(f"{file} holds tensors {found}, but {described} needs {expected}")
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise SurgeryFormatError(
            f"{file} is not the file {folder / MANIFEST} lists for {owner} (its sha256 differs: "
            "copied, swapped or edited since it was written): restore it, or re-run "
            "`mergekit-darts calibrate ... --overwrite`"
        )
    return load_state(build(), tensors)


def load_routed(folder: str | Path, *, weights: str | Path | None = None) -> RoutedSurgery:
    """Every routed task's module behind the router of ``surgery/router.safetensors``.

    Refused with one line: a folder without a router (its block had no ``route:``), a router
    naming tasks the folder lacks, or a router file whose tensors do not fit the manifest.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    entry = manifest.router
    if entry is None:
        raise SurgeryFormatError(
            f"{folder} has no router, so surgery={ROUTED} cannot be used: add `route:` to the "
            "surgery block (two or more tasks) and re-run `mergekit-darts calibrate`"
        )
    if missing := [task for task in entry.tasks if task not in manifest.tasks]:
        raise SurgeryFormatError(
            f"{folder / MANIFEST}: the router weighs task(s) {', '.join(missing)} that the folder "
            f"does not hold (it has {', '.join(manifest.tasks)}); re-run `mergekit-darts calibrate`"
        )
    check_calibrated_on(manifest, folder, weights)
    classes = entry.classes
    described = (
        f"a router over {len(classes)} classes ({', '.join(classes)}) with "
        f"hidden_size={manifest.hidden_size}"
    )
    router = _load_bound(
        lambda: Router(manifest.hidden_size, entry.tasks, entry.background),
        folder,
        entry.file,
        entry.sha256,
        "the router",
        described,
    )
    modules = {task: _load_module(folder, manifest, task) for task in entry.tasks}
    return RoutedSurgery(modules, router).eval()


def load_joint(folder: str | Path, *, weights: str | Path | None = None) -> SurgeryModule:
    """The joint correction of ``surgery/joint.safetensors`` (kind ``none`` when its verdict
    kept none), checked as a task's module is; one line where the block fitted none."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    entry = manifest.joint
    if entry is None:
        raise SurgeryFormatError(
            f"{folder} has no joint correction, so surgery={JOINT} cannot be used: it is fitted "
            "for blocks of two or more tasks judged by the verdict with a plain candidate "
            "(module head or norm, e.g. plain: true); re-run `mergekit-darts calibrate`"
        )
    check_calibrated_on(manifest, folder, weights)
    kind, hidden = entry.module, manifest.hidden_size
    described = f"a joint {kind} module with hidden_size={hidden}"

    def build() -> SurgeryModule:
        return correction_module(kind, hidden, entry.rank, entry.max_positions)

    owner = "the joint correction"
    return _load_bound(build, folder, entry.file, entry.sha256, owner, described).eval()


def _require_finite(folder: Path, modules: Mapping[str, SurgeryModule], manifest: Manifest) -> None:
    """No module weight or manifest number that is NaN or inf is ever written: one line if so."""
    refused = f"refusing to write {folder}: nothing was written and any existing folder stays"
    for name, module in modules.items():
        for key, tensor in module.state_dict().items():
            if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
                raise SurgeryFormatError(
                    f"surgery task {name!r}: {key} holds values that are not finite (NaN or "
                    f"inf); {refused}"
                )
    # Python mode: the JSON form would already have turned NaN and inf into null.
    for where, value in _numbers(manifest.model_dump(), "manifest"):
        if not math.isfinite(value):
            raise SurgeryFormatError(f"{where} is {value}, not a finite number; {refused}")


def _numbers(value: Any, where: str) -> Iterator[tuple[str, float]]:
    """Every float inside nested dicts and lists, with its key path."""
    if isinstance(value, float):
        yield where, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _numbers(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{where}[{index}]")


def write_surgery_folder(
    folder: str | Path,
    modules: Mapping[str, SurgeryModule],
    manifest: Manifest | Mapping[str, Any],
    *,
    extra_files: Mapping[str, bytes] | None = None,
    router: Router | None = None,
    joint: SurgeryModule | None = None,
    replace: bool = True,
) -> Path:
    """Write modules + manifest to ``folder`` atomically (temporary sibling, then rename).

    ``manifest`` (typed, or its dict form) has an entry for every module; each entry's ``file`` is
    filled in here.
    ``extra_files`` (relative name -> bytes: diagnostics, the surgery YAML) land in the same
    staging folder, so they appear together with the modules or not at all.
    ``router`` (with ``manifest.router`` describing it) is written to ``router.safetensors``,
    ``joint`` (with ``manifest.joint``) to ``joint.safetensors``.
    An existing ``folder`` is replaced only after the new one is complete; without ``replace``
    it is not (``FileExistsError``).
    """
    folder = Path(folder)
    if not isinstance(manifest, Manifest):
        manifest = Manifest.from_dict(manifest, where="the manifest to write")
    if (router is None) != (manifest.router is None):
        raise ValueError("pass the router together with the manifest's router entry, or neither")
    if (joint is None) != (manifest.joint is None):
        raise ValueError(
            "pass the joint module together with the manifest's joint entry, or neither"
        )
    extra_modules = {ROUTED: router, JOINT: joint}
    checked = {name: m for name, m in extra_modules.items() if m is not None}
    _require_finite(folder, {**modules, **checked}, manifest)
    for name in extra_files or {}:
        relative_file_name(name)
    with staged_folder(folder, replace=replace) as staging:
        for name, module in modules.items():
            file = module_file(name)
            manifest.tasks[name].sha256 = _write_tensors(staging / file, module)
            manifest.tasks[name].file = file
        if router is not None:
            manifest.router.sha256 = _write_tensors(staging / ROUTER, router)
            manifest.router.file = ROUTER
        if joint is not None:
            manifest.joint.sha256 = _write_tensors(staging / JOINT_FILE, joint)
            manifest.joint.file = JOINT_FILE
        for name, data in (extra_files or {}).items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
        text = json.dumps(manifest.to_dict(), indent=2, sort_keys=False) + "\n"
        (staging / MANIFEST).write_text(text)
    return folder


def _write_tensors(path: Path, module: torch.nn.Module) -> str:
    """``module``'s tensors as float32 safetensors at ``path``; returns the file's sha256 (which
    the manifest records, binding the file to its entry)."""
    state = {
        k: v.detach().to("cpu", torch.float32).contiguous() for k, v in module.state_dict().items()
    }
    # One metadata key only: safetensors writes metadata from a hash map, so two keys come out in
    # random order and identical runs would give different bytes. Bytes through a plain write:
    # safetensors' save_file would make the file 0600.
    data = save(state, metadata={"format": FORMAT})
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()
