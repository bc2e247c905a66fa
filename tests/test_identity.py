"""A surgery belongs to the weights it was calibrated on.

The manifest records the merged folder's content identity; ``load_surgery``, ``apply_surgery``,
``hf-darts`` and ``export`` refuse a folder whose weights were merged again with other weights,
and an exported folder refuses weight files that changed under its links. Copies of a merged
folder, and hardlinks to it, keep their surgery. Merges here are real mergekit runs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import tiny
import torch
import yaml
from click.testing import CliRunner
from tiny import BIN, script_env
from transformers import AutoModelForCausalLM

from mergekit_darts import apply_surgery, load_surgery, run_surgery
from mergekit_darts.errors import SurgeryFormatError
from mergekit_darts.folder import identity
from mergekit_darts.folder.artifacts import read_manifest
from mergekit_darts.folder.identity import cache_key as model_identity
from mergekit_darts.folder.identity import weights_identity
from mergekit_darts.hosts.deploy.export import export

pytestmark = pytest.mark.slow  # every test here trains, merges or starts a process

HIDDEN, RANK, MAX_POSITIONS = 64, 4, 12
REDO = "was calibrated on other weights than those in"


def write_surgery(merged: Path, identity: str | None) -> Path:
    """A one-task surgery/ (random module) recording ``identity`` as the weights it belongs to."""
    modules = tiny.random_modules({"math": "pos_corr"}, HIDDEN, RANK, MAX_POSITIONS)
    recorded = {} if identity is None else {"merged_identity": identity}
    return tiny.write_surgery(
        merged / "surgery", modules, entries={"math": {"eval_tasks": []}}, **recorded
    )


@pytest.fixture
def merged(tiny_family: Any, tmp_path: Path) -> Path:
    """A merge with a surgery/ that records the identity of its weights."""
    out = tiny.merge_family(tiny_family, tmp_path / "merged")
    write_surgery(out, weights_identity(out))
    return out


def test_calibration_records_the_identity_of_the_weights(tiny_family, calibration_data, tmp_path):
    out = tiny.merge_family(tiny_family, tmp_path / "merged")
    written = run_surgery(out, tiny.one_task_block(tiny_family, calibration_data), progress=False)
    assert written["merged_identity"] == weights_identity(out) is not None
    tiny.merge_family(tiny_family, out, math_weight=0.3)  # other weights into the same folder
    with pytest.raises(SurgeryFormatError, match=REDO):
        load_surgery(out / "surgery")


def test_every_loader_refuses_a_surgery_of_other_weights(tiny_family, merged, tmp_path):
    from lm_eval_darts.model import DartsHFLM

    model = AutoModelForCausalLM.from_pretrained(merged)
    # a stock re-merge: surgery/ stays behind
    tiny.merge_family(tiny_family, merged, math_weight=0.3)
    loaders = {
        "load_surgery": lambda: load_surgery(merged / "surgery"),
        "apply_surgery": lambda: apply_surgery(model, merged / "surgery"),
        "hf-darts": lambda: DartsHFLM(pretrained=str(merged), device="cpu"),
        "export": lambda: export(merged, tmp_path / "dest", "math"),
    }
    for name, load in loaders.items():
        with pytest.raises(SurgeryFormatError) as info:
            load()
        message = str(info.value)
        assert REDO in message and "re-run `mergekit-darts calibrate" in message, name
        assert "\n" not in message, name
    assert not (tmp_path / "dest").exists()


def test_identical_remerge_copies_and_hardlinks_keep_their_surgery(tiny_family, merged, tmp_path):
    tiny.merge_family(tiny_family, merged)  # the same merge again: the same weights
    load_surgery(merged / "surgery")
    copy = Path(shutil.copytree(merged, tmp_path / "copy"))  # new inodes and mtimes
    load_surgery(copy / "surgery")
    assert model_identity(str(copy)) != model_identity(str(merged))  # the store's key differs
    export(merged, tmp_path / "linked", "math", link="hardlink")  # changes the shards' ctime
    load_surgery(merged / "surgery")


def test_what_has_nothing_to_compare_is_accepted(tiny_family, merged, tmp_path):
    """A manifest from before the identity was recorded; a surgery/ kept outside a model folder."""
    old = tiny.merge_family(tiny_family, tmp_path / "old")
    write_surgery(old, None)
    tiny.merge_family(tiny_family, old, math_weight=0.3)
    load_surgery(old / "surgery")
    outside = Path(shutil.copytree(merged / "surgery", tmp_path / "kept" / "surgery"))
    tiny.merge_family(tiny_family, merged, math_weight=0.3)
    load_surgery(outside)
    with pytest.raises(SurgeryFormatError, match=REDO):  # unless told which weights it corrects
        load_surgery(outside, weights=merged)


def test_apply_surgery_checks_the_model_it_corrects(tiny_family, merged, tmp_path):
    """The weights compared are the model's own folder, wherever the surgery folder lies."""
    other = tiny.merge_family(tiny_family, tmp_path / "other", math_weight=0.3)
    model = AutoModelForCausalLM.from_pretrained(other)
    with pytest.raises(SurgeryFormatError, match=f"{REDO} {other}"):
        apply_surgery(model, merged / "surgery")
    same = AutoModelForCausalLM.from_pretrained(shutil.copytree(merged, tmp_path / "same"))
    apply_surgery(same, merged / "surgery").remove()


def test_manifest_identity_round_trips(merged):
    manifest = read_manifest(merged / "surgery")
    assert manifest.merged_identity == weights_identity(merged)
    data = json.loads((merged / "surgery" / "manifest.json").read_text())
    assert data["merged_identity"] == manifest.to_dict()["merged_identity"]


def test_a_symlinked_export_refuses_weights_merged_again_under_it(tiny_family, merged, tmp_path):
    dest = export(merged, tmp_path / "dest", "math", link="symlink")[0]
    loaded = AutoModelForCausalLM.from_pretrained(dest, trust_remote_code=True)
    assert loaded.darts_surgery.down.weight.abs().sum() > 0
    tiny.merge_family(tiny_family, merged, math_weight=0.3)  # the link now reaches the new weights
    with pytest.raises(ValueError, match="is not the weight file this DARTS export was made with"):
        AutoModelForCausalLM.from_pretrained(dest, trust_remote_code=True)


@pytest.mark.parametrize("link", ["hardlink", "copy"])
def test_hardlinked_and_copied_exports_keep_their_weights(tiny_family, merged, tmp_path, link):
    """mergekit writes new files, so a hardlink keeps the exported weights as a copy does."""
    dest = export(merged, tmp_path / "dest", "math", link=link)[0]
    before = AutoModelForCausalLM.from_pretrained(dest, trust_remote_code=True)
    tiny.merge_family(tiny_family, merged, math_weight=0.3)
    after = AutoModelForCausalLM.from_pretrained(dest, trust_remote_code=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(before(ids).logits, after(ids).logits)


def test_fingerprints_see_every_tensor_and_not_the_recipe(merged, tmp_path):
    from safetensors.torch import load_file, save_file

    key = weights_identity(merged)
    (merged / "mergekit_config.yml").write_text("# rewritten by calibrate\n")
    (merged / "README.md").write_text("card\n")
    assert weights_identity(merged) == key
    store_key = model_identity(str(merged))
    (merged / "mergekit_config.yml").write_text("# again\n")
    assert model_identity(str(merged)) == store_key, "the store's key leaves the recipe out"
    tensors = load_file(merged / "model.safetensors")
    smallest = min(tensors, key=lambda name: tensors[name].numel())  # a norm: 64 numbers
    tensors[smallest] = tensors[smallest] + 1
    save_file(tensors, merged / "model.safetensors", metadata={"format": "pt"})
    assert weights_identity(merged) != key
    assert weights_identity(tmp_path) is None  # no model here: nothing to compare


@pytest.mark.parametrize(
    "weights",
    [
        {"../model.safetensors": "0" * 64},
        {"sub/model.safetensors": "0" * 64},
        {"model.safetensors": "not a digest"},
        ["model.safetensors"],
    ],
)
def test_a_bad_weights_record_gets_a_one_line_error(merged, tmp_path, weights):
    from mergekit_darts.correction.modeling_darts import darts_section

    dest = export(merged, tmp_path / "dest", "math", link="copy")[0]
    config = json.loads((dest / "config.json").read_text())
    config["darts"]["weights"] = weights
    with pytest.raises(ValueError, match="darts.weights must map plain weight file names") as info:
        darts_section(config)
    assert "\n" not in str(info.value)


def test_an_export_missing_a_listed_weight_file_is_refused(merged, tmp_path):
    dest = export(merged, tmp_path / "dest", "math", link="symlink")[0]
    (dest / "model-00001-of-00001.safetensors").unlink()
    with pytest.raises(Exception, match="model-00001-of-00001.safetensors"):
        AutoModelForCausalLM.from_pretrained(dest, trust_remote_code=True)


# ------------------------------------------------------------------------------------------------
# A merged folder that also holds an earlier merge's weights: mergekit never deletes old shards.
#
# Merging into ``out/`` with ``--out-shard-size`` and then again without it (or the other way
# round) leaves ``model.safetensors`` beside ``model-0000k-of-0000n.safetensors`` and their index.
# transformers loads ``model.safetensors`` from such a folder, and so do calibration, ``hf-darts``
# and ``apply_surgery``; the export and the weights identity must follow the same file. Merges
# here are the stock ``mergekit-yaml`` console script.


SHARD_SIZE = "100K"  # the tiny model's 360 KB of weights in four shards


def mergekit_yaml(tiny_family: Any, tmp_path: Path, out: Path, math: float, sharded: bool) -> None:
    recipe = {
        "merge_method": "task_arithmetic",
        "base_model": str(tiny_family.base),
        "models": [
            {"model": str(tiny_family.math), "parameters": {"weight": math}},
            {"model": str(tiny_family.code), "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
    }
    path = tmp_path / f"merge-{math}.yml"
    path.write_text(yaml.safe_dump(recipe))
    command = [str(BIN / "mergekit-yaml"), str(path), str(out)]
    if sharded:
        command += ["--out-shard-size", SHARD_SIZE]
    done = subprocess.run(command, env=script_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.to(torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize("sharded_first", [True, False], ids=["stale-shards", "stale-single"])
def test_export_and_identity_follow_the_file_transformers_loads(
    tiny_family: Any, tmp_path: Path, sharded_first: bool
) -> None:
    out = tmp_path / "out"
    mergekit_yaml(tiny_family, tmp_path, out, math=0.5, sharded=sharded_first)
    mergekit_yaml(tiny_family, tmp_path, out, math=0.2, sharded=not sharded_first)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert (out / "model.safetensors").is_file() and len(shards) > 1
    write_surgery(out, weights_identity(out))

    # the identity is that of the folder without the files transformers does not read
    clean = Path(shutil.copytree(out, tmp_path / "clean"))
    for name in [*shards, "model.safetensors.index.json"]:
        (clean / name).unlink()
    assert weights_identity(out) == weights_identity(clean)
    load_surgery(clean / "surgery")  # the surgery belongs to those weights

    export(out, tmp_path / "dest", "math")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(
        tmp_path / "dest", trust_remote_code=True, dtype=torch.float32
    ).eval()
    state = exported.state_dict()
    for name, tensor in merged.state_dict().items():  # the very weights transformers loads
        assert torch.equal(state[name], tensor), name

    ids = torch.tensor([[2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]])
    apply_surgery(merged, out / "surgery", "math")
    expected = logits(merged, ids)
    assert (logits(exported, ids) - expected).abs().max() <= 1e-5


# ------------------------------------------------------------------------------------------------
# A merge written beside an earlier merge's weights is never calibrated.
#
# The second merge's files do not replace the first's when their layouts differ (one file, or
# shards and their index): transformers would load the earlier ``model.safetensors`` before the
# new shards, so calibrating there would fit the wrong weights. The hooked merge names the file
# it did not write; ``mergekit-darts calibrate`` cannot tell which merge is newer, but says the
# folder holds two.


def merge_recipe(tiny_family: Any, math: float, block: dict[str, Any]) -> dict[str, Any]:
    return {
        "merge_method": "task_arithmetic",
        "base_model": str(tiny_family.base),
        "models": [
            {"model": str(tiny_family.math), "parameters": {"weight": math}},
            {"model": str(tiny_family.code), "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
        "surgery": block,
    }


def hooked_merge(config: dict[str, Any], out: Path, sharded: bool) -> None:
    """The hook's merge path (real mergekit, then the surgery), as ``mergekit-yaml`` with or
    without ``--out-shard-size 100K``, an existing ``surgery/`` replaced as
    ``DARTS_OVERWRITE_SURGERY=1`` asks."""
    import inspect

    import mergekit.merge
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    from mergekit_darts.hosts.mergekit.hook import merge_with_surgery

    options = MergeOptions(quiet=True, out_shard_size=100_000 if sharded else 5 * 10**9)
    merge_with_surgery(
        inspect.unwrap(mergekit.merge.run_merge),
        MergeConfiguration.model_validate(config),
        str(out),
        options,
        yaml.safe_dump(config, sort_keys=False),
        overwrite=True,
    )


@pytest.mark.parametrize(
    ("sharded_first", "stale"),
    [(False, "model.safetensors"), (True, "model.safetensors.index.json")],
    ids=["stale-single", "stale-shards"],
)
def test_a_merge_beside_an_earlier_merges_weights_is_refused_before_calibrating(
    tiny_family: Any,
    calibration_data: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    sharded_first: bool,
    stale: str,
) -> None:
    from mergekit_darts.cli import main
    from mergekit_darts.errors import SurgeryConfigError

    block = tiny.one_task_block(tiny_family, calibration_data)
    out = tmp_path / "out"
    hooked_merge(merge_recipe(tiny_family, 0.5, block), out, sharded=sharded_first)
    assert (out / "surgery").is_dir()
    second = merge_recipe(tiny_family, 0.2, block)
    with pytest.raises(SurgeryConfigError) as info:
        hooked_merge(second, out, sharded=not sharded_first)
    message = str(info.value)
    assert f"{out} still holds {stale}" in message and "from an earlier merge" in message, message
    assert "merge into an empty folder" in message and "\n" not in message
    assert not (out / "surgery").exists()  # the first merge's surgery stays set aside
    assert len(list(out.glob("surgery.set-aside-*"))) == 1

    (tmp_path / "merge.yml").write_text(yaml.safe_dump(second))
    run = CliRunner().invoke(main, ["calibrate", str(out), str(tmp_path / "merge.yml")])
    assert run.exit_code == 1 and run.output.count("\n") == 1, run.output
    assert f"{out} holds two merges" in run.output and stale in run.output, run.output
    assert not (out / "surgery").exists()
    capsys.readouterr()
    plain = {key: value for key, value in second.items() if key != "surgery"}
    hooked_merge(plain, out, sharded=not sharded_first)  # a merge without a block is told
    assert f"{out} still holds {stale}" in capsys.readouterr().err

    unread = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()
    for name in [*set(unread), stale] if sharded_first else [stale]:
        (out / name).unlink()  # what the message asks: the earlier merge's files removed
    identity.check_one_merge(out)
