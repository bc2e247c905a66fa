"""Each surgery file is bound to its manifest entry.

Two modules of one shape (two tasks', or one task's from two runs) differ only in their numbers,
so ``math.safetensors`` replaced by ``code``'s would load and serve the wrong correction. The
manifest records each file's sha256 (the router's too) and every loader checks it: ``load_surgery``,
``apply_surgery``, ``hf-darts``, ``export`` and, in an exported folder, transformers' load (vLLM's
is in ``tests_vllm``). A hand-edited size is checked against the file before anything is
allocated.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tiny
import torch
from transformers import AutoModelForCausalLM

from mergekit_darts import apply_surgery, load_surgery
from mergekit_darts.correction.modeling_darts import SURGERY_FILE
from mergekit_darts.errors import SurgeryFormatError
from mergekit_darts.folder.artifacts import load_routed, read_manifest
from mergekit_darts.hosts.deploy.export import export

HIDDEN, RANK, MAX_POSITIONS = 64, 4, 12
SWAPPED = "sha256 differs"


def write_routed(surgery: Path, seed: int = 0) -> None:
    """Tasks math and code (one shape) behind a router, every weight random."""
    kinds = {"math": "pos_corr", "code": "pos_corr"}
    tiny.write_routed_surgery(
        surgery, HIDDEN, kinds, rank=RANK, max_positions=MAX_POSITIONS, seed=seed
    )


@pytest.fixture
def merged(merged_copy: Path) -> Path:
    """The tiny merge with a routed surgery/."""
    write_routed(merged_copy / "surgery")
    return merged_copy


def swap(a: Path, b: Path) -> None:
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)


def loaders(merged: Path, dest: Path, task: str) -> dict[str, Callable[[], Any]]:
    """Every way to load ``task`` (a surgery task, or "routed") from ``merged/surgery``."""
    from lm_eval_darts.model import DartsHFLM

    surgery = merged / "surgery"
    model = AutoModelForCausalLM.from_pretrained(merged)
    routed = task == "routed"
    return {
        "load": (lambda: load_routed(surgery)) if routed else (lambda: load_surgery(surgery, task)),
        "apply_surgery": lambda: apply_surgery(model, surgery, task),
        "hf-darts": lambda: DartsHFLM(pretrained=str(merged), surgery=task, device="cpu"),
        "export": (
            (lambda: export(merged, dest, routed=True))
            if routed
            else (lambda: export(merged, dest, task))
        ),
    }


def assert_refused(load: Callable[[], Any], name: str, *words: str) -> None:
    with pytest.raises(SurgeryFormatError) as info:
        load()
    message = str(info.value)
    assert "\n" not in message, name
    assert all(word in message for word in words), (name, message)


def test_the_manifest_records_each_files_sha256(merged):
    manifest = read_manifest(merged / "surgery")
    files = {name: entry.file for name, entry in manifest.tasks.items()}
    files["router"] = manifest.router.file
    recorded = {name: entry.sha256 for name, entry in manifest.tasks.items()}
    recorded["router"] = manifest.router.sha256
    for name, file in files.items():
        expected = hashlib.sha256((merged / "surgery" / file).read_bytes()).hexdigest()
        assert recorded[name] == expected, name


def test_swapped_module_files_are_refused_by_every_loader(merged, tmp_path):
    surgery = merged / "surgery"
    swap(surgery / "math.safetensors", surgery / "code.safetensors")
    for task in ("math", "routed"):
        for name, load in loaders(merged, tmp_path / "dest", task).items():
            assert_refused(load, f"{task} {name}", SWAPPED, "math.safetensors")
    assert not (tmp_path / "dest").exists()


def test_a_router_file_from_another_run_is_refused(merged, tmp_path):
    surgery = merged / "surgery"
    write_routed(tmp_path / "other", seed=7)
    shutil.copyfile(tmp_path / "other" / "router.safetensors", surgery / "router.safetensors")
    for name, load in loaders(merged, tmp_path / "dest", "routed").items():
        assert_refused(load, name, SWAPPED, "router.safetensors", "the router")
    # the tasks' own files are untouched: loading one task alone still works
    assert load_surgery(surgery, "math") is not None


def test_an_edited_module_file_is_refused_but_an_unrecorded_hash_is_accepted(merged):
    surgery = merged / "surgery"
    before = load_surgery(surgery, "math").state_dict()
    manifest = json.loads((surgery / "manifest.json").read_text())
    del manifest["tasks"]["math"]["sha256"]  # as written before it was recorded
    (surgery / "manifest.json").write_text(json.dumps(manifest))
    after = load_surgery(surgery, "math").state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    manifest["tasks"]["math"]["sha256"] = "0" * 64
    (surgery / "manifest.json").write_text(json.dumps(manifest))
    assert_refused(lambda: load_surgery(surgery, "math"), "load", SWAPPED)
    manifest["tasks"]["math"]["sha256"] = "not a hash"
    (surgery / "manifest.json").write_text(json.dumps(manifest))
    assert_refused(lambda: load_surgery(surgery, "math"), "load", "tasks.math.sha256")


def test_an_exported_surgery_file_swapped_with_another_exports_is_refused(merged, tmp_path):
    math, code = export(merged, tmp_path / "math", "math")[0], tmp_path / "code"
    export(merged, code, "code")
    config = json.loads((math / "config.json").read_text())
    assert SURGERY_FILE in config["darts"]["weights"]
    swap(math / SURGERY_FILE, code / SURGERY_FILE)
    for folder in (math, code):
        with pytest.raises(
            ValueError, match=f"{SURGERY_FILE} is not the surgery file this DARTS export"
        ):
            AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)


@pytest.mark.parametrize(
    "key, value",
    [("rank", 2**40), ("max_positions", 2**40), ("hidden_size", 2**40)],
)
def test_a_hand_edited_huge_size_is_refused_before_allocating(merged, key, value):
    """2**40 rows of 64 floats would be 256 TiB: the allocator must never be asked."""
    surgery = merged / "surgery"
    manifest = json.loads((surgery / "manifest.json").read_text())
    if key == "hidden_size":
        manifest[key] = value
    else:
        manifest["tasks"]["math"][key] = value
    (surgery / "manifest.json").write_text(json.dumps(manifest))
    assert_refused(lambda: load_surgery(surgery, "math"), key, "math.safetensors", "needs")
    if key == "hidden_size":
        assert_refused(lambda: load_routed(surgery), "router", "router.safetensors", "needs")


def test_an_entry_naming_another_tasks_file_is_refused(merged):
    """code's entry pointing at math's file (with math's hash) would serve math's module."""
    surgery = merged / "surgery"
    manifest = json.loads((surgery / "manifest.json").read_text())
    for key in ("file", "sha256"):
        manifest["tasks"]["code"][key] = manifest["tasks"]["math"][key]
    (surgery / "manifest.json").write_text(json.dumps(manifest))
    assert_refused(
        lambda: load_surgery(surgery, "code"),
        "load",
        "tasks: task 'code' names file 'math.safetensors', not its own 'code.safetensors'",
    )
