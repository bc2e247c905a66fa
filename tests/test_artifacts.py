"""Surgery folders: bit-exact round trip, atomic writes, and clear errors for bad files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from tiny import random_module, write_surgery

from mergekit_darts import load_surgery
from mergekit_darts.errors import SurgeryFormatError
from mergekit_darts.folder.artifacts import read_manifest, write_surgery_folder
from mergekit_darts.folder.manifest import plain_file_name, relative_file_name

H, R, T = 12, 3, 6


def _module(kind="pos_corr", seed=0):
    return random_module(kind, H, R, T, seed, scale=1.0)


def _write(folder, modules):
    entries = dict.fromkeys(modules, {"loss": "ewl1", "eval_tasks": []})
    return write_surgery(folder, modules, entries=entries, vocab_size=50)


def test_round_trip_is_bit_exact(tmp_path):
    modules = {"math": _module("pos_corr", 1), "code": _module("standard", 2)}
    folder = _write(tmp_path / "surgery", modules)
    for name, original in modules.items():
        loaded = load_surgery(folder, name)
        assert type(loaded) is type(original)
        for key, value in original.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value)
    manifest = read_manifest(folder)
    assert manifest.format == "darts-surgery" and manifest.version == 1
    assert manifest.tasks["math"].file == "math.safetensors"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["surgery"]  # no staging left behind
    mode = (folder / "manifest.json").stat().st_mode  # plain files, not safetensors' 0600
    assert all((folder / f"{name}.safetensors").stat().st_mode == mode for name in modules)


def test_rewrite_replaces_folder_atomically(tmp_path):
    folder = _write(tmp_path / "surgery", {"math": _module(seed=1)})
    _write(folder, {"code": _module(seed=2)})
    assert sorted(p.name for p in folder.iterdir()) == ["code.safetensors", "manifest.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["surgery"]


def test_single_task_needs_no_name_several_do(tmp_path):
    one = _write(tmp_path / "one", {"math": _module()})
    assert load_surgery(one).kind == "pos_corr"
    two = _write(tmp_path / "two", {"math": _module(), "code": _module()})
    with pytest.raises(SurgeryFormatError, match=r"several surgery tasks \(math, code\)"):
        load_surgery(two)
    with pytest.raises(SurgeryFormatError, match="no surgery task 'chat'.*available: math, code"):
        load_surgery(two, "chat")


def _edit_manifest(folder, **changes):
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda f: (f / "manifest.json").unlink(), "no surgery manifest"),
        (lambda f: (f / "manifest.json").write_text("{oops"), "not valid JSON"),
        (lambda f: _edit_manifest(f, format="other"), "is not a 'darts-surgery' manifest"),
        (lambda f: _edit_manifest(f, version=99), "format version 99"),
        (lambda f: _edit_manifest(f, tasks={}), "lists no surgery tasks"),
        (lambda f: _edit_manifest(f, format=None), "is not a 'darts-surgery' manifest"),
        (
            lambda f: _edit_manifest(f, tasks={"math": {"module": "lora", "rank": R}}),
            r"manifest.tasks.math.module: 'lora' is not allowed; choose one of standard, pos_corr",
        ),
        (
            lambda f: _edit_manifest(f, tasks={"math": {"module": "pos_corr", "rank": 0}}),
            "manifest.tasks.math.rank: must be > 0",
        ),
        (
            lambda f: _edit_manifest(f, hidden_size=13),
            r"hidden_size=13.* needs \{'down.weight': \(3, 13\)",
        ),
        (lambda f: (f / "math.safetensors").unlink(), "surgery file .* is missing"),
        (
            lambda f: (f / "math.safetensors").write_bytes(b"\x00garbage"),
            "not a readable safetensors",
        ),
        (
            lambda f: save_file({"down.weight": torch.zeros(R, H)}, f / "math.safetensors"),
            "holds tensors",
        ),
    ],
)
def test_corrupted_folders_are_rejected(tmp_path, corrupt, message):
    folder = _write(tmp_path / "surgery", {"math": _module()})
    corrupt(folder)
    with pytest.raises(SurgeryFormatError, match=message) as err:
        load_surgery(folder, "math")
    assert "\n" not in str(err.value)


def test_failed_write_leaves_old_folder(tmp_path):
    folder = _write(tmp_path / "surgery", {"math": _module()})
    before = (folder / "math.safetensors").read_bytes()
    with pytest.raises(KeyError):
        write_surgery_folder(folder, {"code": _module()}, {"hidden_size": H, "tasks": {}})
    assert (folder / "math.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["surgery"]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["tasks"].update({"../escaped": m["tasks"]["math"]}), "not a valid task name"),
        (lambda m: m["tasks"].update({"auto": m["tasks"]["math"]}), "reserved by hf-darts"),
        (lambda m: m["tasks"]["math"].update(file="/etc/passwd"), "must be a plain file name"),
        (lambda m: m["tasks"]["math"].update(file="../math.safetensors"), "plain file name"),
        (lambda m: m["tasks"]["math"].update(file="sub/math.safetensors"), "plain file name"),
        (lambda m: m["tasks"]["math"].update(diagnostics="../../x.safetensors"), "relative path"),
        (lambda m: m.update(config="/tmp/surgery.yml"), "plain file name inside surgery/"),
    ],
)
def test_crafted_manifests_cannot_point_outside_surgery(tmp_path, edit, message):
    """Manifests travel with downloaded merges: names and files stay inside surgery/."""
    folder = _write(tmp_path / "surgery", {"math": _module()})
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(SurgeryFormatError, match=message) as err:
        load_surgery(folder, "math")
    assert "\n" not in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "./a", "/a", "a\\b"])
def test_plain_file_name_refuses_every_other_name(name):
    with pytest.raises(ValueError, match="plain file name"):
        plain_file_name(name)


@pytest.mark.parametrize("name", ["", "/a", "../a", "a/../../b", "a\\b"])
def test_extra_files_stay_inside_the_folder(tmp_path, name):
    """The writer and the manifest share one check of where a relative name may lead."""
    with pytest.raises(ValueError, match="relative path inside surgery/"):
        relative_file_name(name)
    with pytest.raises(ValueError, match="relative path inside surgery/"):
        write_surgery_folder(
            tmp_path / "surgery",
            {"math": _module()},
            {
                "hidden_size": H,
                "tasks": {
                    "math": {
                        "module": "pos_corr",
                        "rank": R,
                        "max_positions": T,
                        "loss": "ewl1",
                        "eval_tasks": [],
                    }
                },
            },
            extra_files={name: b"x"},
        )
    assert not (tmp_path / "surgery").exists()
