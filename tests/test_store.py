"""The capture store: one load per distinct model, none when warm, and never a stale or broken entry.

Loads are counted with a wrapper around ``AutoModelForCausalLM.from_pretrained`` that still calls
the real function; every run below is the real ``run_surgery`` on tiny real models.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny import save_model, surgery_task
from transformers import AutoModelForCausalLM

from mergekit_darts import run_surgery
from mergekit_darts.calibrate.store import CaptureStore, sequences_sha256
from mergekit_darts.folder.identity import cache_key as model_identity


@pytest.fixture
def loads(monkeypatch) -> list[str]:
    """Folder names of every model ``from_pretrained`` loads (the real function runs)."""
    loaded: list[str] = []
    original = AutoModelForCausalLM.from_pretrained

    def counting(path, *args, **kwargs):
        loaded.append(Path(path).name)
        return original(path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counting)
    return loaded


@pytest.fixture
def family(tiny_family, merged_copy, calibration_data, tmp_path) -> dict[str, Path]:
    """Copies of the merge and both experts (tests rewrite them) and the calibration files."""
    return {
        "merged": merged_copy,
        "math": Path(shutil.copytree(tiny_family.math, tmp_path / "math")),
        "code": Path(shutil.copytree(tiny_family.code, tmp_path / "code")),
        "data": calibration_data,
    }


def block(family: dict[str, Path], cache_dir: Path | None = None) -> dict:
    """Three tasks over two targets: math twice (l1 and ewl1, one set of prompts), code once."""
    calibration = {"num_samples": 6, "max_length": 16}
    math, code = family["data"] / "math.jsonl", family["data"] / "code.jsonl"
    tasks = [
        surgery_task("math", family["math"], math, calibration=calibration, loss="l1"),
        surgery_task("math_ewl1", family["math"], math, calibration=calibration, eval_tasks=["m2"]),
        surgery_task("code", family["code"], code, calibration=calibration, module="standard"),
    ]
    config = {"steps": 6, "batch_size": 4, "rank": 4, "max_positions": 16, "tasks": tasks}
    config["select"] = "off"  # one module per task: the capture counts below are its
    config["cache_dtype"] = "float32"
    if cache_dir is not None:
        config["cache_dir"] = str(cache_dir)
    return config


def module_bytes(merged: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((merged / "surgery").glob("*.safetensors"))}


@pytest.mark.slow
def test_shared_target_loads_once_and_a_warm_store_loads_nothing(family, loads, tmp_path):
    cache = tmp_path / "cache"
    first = run_surgery(family["merged"], block(family, cache), progress=False)
    assert loads == ["math", "code", "merged"]  # distinct targets + 1, not tasks + 1
    assert first["captures"]["model_loads"] == 3
    cold = module_bytes(family["merged"])
    loads.clear()
    second = run_surgery(family["merged"], block(family, cache), overwrite=True, progress=False)
    assert loads == []  # every capture came from disk
    assert second["captures"]["from_disk"] > 0 and second["captures"]["computed"] == 0
    assert module_bytes(family["merged"]) == cold  # the store changes no number


@pytest.mark.slow
def test_sharing_and_the_store_change_no_byte(family, tmp_path):
    """Each task alone in its own block, no store: the same module bytes as the shared run."""
    config = block(family)
    run_surgery(family["merged"], config, progress=False)
    shared = module_bytes(family["merged"])
    for task in config["tasks"]:
        alone = Path(shutil.copytree(family["merged"], tmp_path / f"alone-{task['name']}"))
        shutil.rmtree(alone / "surgery")
        run_surgery(alone, {**config, "tasks": [task]}, progress=False)
        name = f"{task['name']}.safetensors"
        assert module_bytes(alone)[name] == shared[name], name


def rewrite_weights(folder: Path, seed: int) -> None:
    """Same architecture and file name, other weights (what a re-run fine-tune leaves behind)."""
    from transformers import AutoTokenizer

    save_model(folder, AutoTokenizer.from_pretrained(folder), seed=seed)


@pytest.mark.slow
def test_changed_weights_or_tokenizer_mean_a_new_key(family, loads, tmp_path):
    cache = tmp_path / "cache"
    run_surgery(family["merged"], block(family, cache), progress=False)
    before = module_bytes(family["merged"])
    key = model_identity(str(family["math"]))
    rewrite_weights(family["math"], seed=7)
    assert model_identity(str(family["math"])) != key
    loads.clear()
    run_surgery(family["merged"], block(family, cache), overwrite=True, progress=False)
    assert loads == ["math"]  # code and the merge still come from disk
    after = module_bytes(family["merged"])
    assert after["math.safetensors"] != before["math.safetensors"]
    assert after["code.safetensors"] == before["code.safetensors"]

    config = json.loads((family["code"] / "tokenizer_config.json").read_text())
    config["model_max_length"] = 77  # any tokenizer change: new key
    (family["code"] / "tokenizer_config.json").write_text(json.dumps(config))
    loads.clear()
    run_surgery(family["merged"], block(family, cache), overwrite=True, progress=False)
    assert loads == ["code"]


@pytest.mark.slow
def test_only_the_files_a_load_reads_are_in_a_models_key(family, loads, tmp_path):
    """An earlier save's shards and index beside a target's ``model.safetensors`` are never
    loaded (transformers reads the single file first): removing them keeps a warm store warm;
    rewriting the file it reads does not."""
    cache = tmp_path / "cache"
    math = family["math"]
    shard = "model-00001-of-00001.safetensors"
    shutil.copy(math / "model.safetensors", math / shard)
    tensors = load_file(math / shard)
    index = {"metadata": {}, "weight_map": dict.fromkeys(tensors, shard)}
    (math / "model.safetensors.index.json").write_text(json.dumps(index))
    run_surgery(family["merged"], block(family, cache), progress=False)
    (math / shard).unlink()
    (math / "model.safetensors.index.json").unlink()
    loads.clear()
    run_surgery(family["merged"], block(family, cache), overwrite=True, progress=False)
    assert loads == []  # the same files read: the same key
    rewrite_weights(math, seed=7)
    loads.clear()
    run_surgery(family["merged"], block(family, cache), overwrite=True, progress=False)
    assert loads == ["math"]


@pytest.mark.slow
def test_card_and_surgery_do_not_change_a_models_key(family):
    key = model_identity(str(family["merged"]))
    run_surgery(family["merged"], block(family), progress=False)  # writes surgery/ and README.md
    assert model_identity(str(family["merged"])) == key
    assert model_identity("org/some-model") == "hub:org/some-model"


@pytest.mark.slow
def test_corrupt_or_partial_entry_is_recomputed_never_used(family, loads, tmp_path):
    cache = tmp_path / "cache"
    run_surgery(family["merged"], block(family, cache), progress=False)
    good = module_bytes(family["merged"])
    entries = sorted((cache / "captures").glob("*.safetensors"))
    # math (one capture for its two tasks), code, and the merge once: both files hold one prompt set
    assert len(entries) == 3
    for entry in entries:
        data = entry.read_bytes()
        entry.write_bytes(data[: len(data) // 2])  # a kill mid-write without the rename
    loads.clear()
    run_surgery(family["merged"], block(family, cache), overwrite=True, progress=False)
    assert loads == ["math", "code", "merged"]
    assert module_bytes(family["merged"]) == good
    for entry in entries:  # rewritten whole
        assert set(load_file(entry)) >= {"hidden", "mask"}
    assert not list(cache.rglob(".*tmp*"))


def test_entry_that_does_not_fit_its_sequences_is_a_miss(tmp_path):
    store = CaptureStore(tmp_path)
    from mergekit_darts.calibrate.capture import Captured

    hidden = torch.ones(2, 3, 4)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    store.put("k", Captured(hidden, mask), model="local:m")
    fresh = CaptureStore(tmp_path)
    assert fresh.get("k", [3, 2], torch.float32, "cpu", model="local:m") is not None
    assert (
        CaptureStore(tmp_path).get("k", [3, 3], torch.float32, "cpu", model="local:m") is None
    )  # wrong lengths
    assert not (tmp_path / "captures" / "k.safetensors").exists()  # discarded
    store.put("k", Captured(hidden, mask), model="local:m")
    needs_entropy = CaptureStore(tmp_path).get(
        "k", [3, 2], torch.float32, "cpu", (True, False), model="local:m"
    )
    assert needs_entropy is None  # an entry without entropy cannot serve a target
    assert sequences_sha256([[1, 2], [3]]) != sequences_sha256([[1], [2, 3]])
    assert "MiB" in store.summary() and "1 entries" in store.summary()


@pytest.mark.slow
def test_calibrate_cache_dir_option_overrides_the_block(family, loads, tmp_path):
    from click.testing import CliRunner

    from mergekit_darts.cli import main

    config = tmp_path / "surgery.yml"
    config.write_text(json.dumps(block(family)))  # JSON is YAML; the block has no cache_dir
    args = ["calibrate", str(family["merged"]), str(config), "--quiet", "--overwrite"]
    args += ["--cache-dir", str(tmp_path / "cli-cache")]
    for expected in (["math", "code", "merged"], []):
        loads.clear()
        run = CliRunner().invoke(main, args)
        assert run.exit_code == 0, run.output
        assert loads == expected
    assert list((tmp_path / "cli-cache" / "captures").glob("*.safetensors"))


def test_unwritable_cache_dir_is_refused_before_any_load(family, loads, tmp_path):
    from mergekit_darts.errors import SurgeryConfigError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(SurgeryConfigError, match=r"surgery.cache_dir: cannot write the capture"):
        run_surgery(family["merged"], block(family, blocker / "cache"), progress=False)
    assert loads == [] and not (family["merged"] / "surgery").exists()


def _overwrite_hidden_bytes(entry: Path) -> None:
    """The bytes of the ``hidden`` tensor become 0xFF (float NaN); header and other tensors intact."""
    data = bytearray(entry.read_bytes())
    size = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8 : 8 + size])["hidden"]["data_offsets"]
    data[8 + size + begin : 8 + size + end] = b"\xff" * (end - begin)
    entry.write_bytes(bytes(data))


@pytest.mark.slow
def test_changed_tensor_bytes_under_an_intact_header_are_recomputed(family, loads, tmp_path):
    """Bit rot or a foreign writer is caught by the entry's checksum, never trained on."""
    cache = tmp_path / "cache"
    run_surgery(family["merged"], block(family, cache), progress=False)
    good = module_bytes(family["merged"])
    entries = sorted((cache / "captures").glob("*.safetensors"))
    for entry in entries:
        _overwrite_hidden_bytes(entry)
        assert torch.isnan(load_file(entry)["hidden"]).all()  # readable, shapes intact, all NaN
    loads.clear()
    manifest = run_surgery(family["merged"], block(family, cache), overwrite=True, progress=False)
    assert loads == ["math", "code", "merged"]  # every damaged entry recomputed
    assert module_bytes(family["merged"]) == good
    assert all(
        torch.isfinite(torch.tensor(t["metrics"]["rho_l1"])) for t in manifest["tasks"].values()
    )
    for entry in entries:
        assert torch.isfinite(load_file(entry)["hidden"]).all()


def test_store_bytes_are_reproducible_and_a_non_finite_entry_is_a_miss(tmp_path):
    """One metadata value (safetensors orders several at random); NaN with a valid checksum: a miss."""
    from mergekit_darts.calibrate.capture import Captured

    mask = torch.tensor([[True, True, True], [True, True, False]])
    hidden = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    first, second = CaptureStore(tmp_path / "a"), CaptureStore(tmp_path / "b")
    first.put("k", Captured(hidden, mask), model="local:m")
    second.put("k", Captured(hidden, mask), model="local:m")
    entry = tmp_path / "a" / "captures" / "k.safetensors"
    assert entry.read_bytes() == (tmp_path / "b" / "captures" / "k.safetensors").read_bytes()
    hidden[0, 1, 2] = float("inf")
    first.put("k", Captured(hidden, mask), model="local:m")  # a writer that checks nothing
    assert (
        CaptureStore(tmp_path / "a").get("k", [3, 2], torch.float32, "cpu", model="local:m") is None
    )
    assert not entry.exists()  # discarded: the next capture overwrites it


def _poison(folder: Path) -> None:
    """One NaN in the final norm: the model computes NaN hidden states on every token."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    model.save_pretrained(folder)


@pytest.mark.slow
def test_a_model_computing_nan_stops_with_one_line_and_keeps_surgery(family, tmp_path):
    from mergekit_darts.errors import SurgeryRunError

    config = block(family, tmp_path / "cache")
    run_surgery(family["merged"], config, progress=False)
    good = module_bytes(family["merged"])
    _poison(family["code"])
    with pytest.raises(SurgeryRunError) as caught:
        run_surgery(family["merged"], config, overwrite=True, progress=False)
    message = str(caught.value)
    assert "\n" not in message
    assert f"surgery task 'code': target {family['code']} computes hidden states" in message
    assert "not finite" in message and "check its weights" in message
    assert module_bytes(family["merged"]) == good  # the previous surgery/ stays


def test_cache_dtype_overflow_is_named(family):
    from mergekit_darts.calibrate.capture import NonFiniteCapture, capture

    model = AutoModelForCausalLM.from_pretrained(family["merged"])
    with torch.no_grad():
        model.model.norm.weight.mul_(1e6)  # finite in float32, beyond float16's 65504
    with pytest.raises(
        NonFiniteCapture, match=r"cast to the cache dtype torch.float16.*cache_dtype"
    ):
        capture(model, [[1, 2, 3]], cache_dtype=torch.float16, progress=False)


@pytest.mark.slow
def test_a_full_disk_warns_and_the_run_goes_on(family, loads, tmp_path, monkeypatch, caplog):
    """The optional store failing to write is one warning, not a failed run."""
    import errno

    from safetensors import SafetensorError

    from mergekit_darts.calibrate import store

    for error in (
        OSError(errno.ENOSPC, "No space left on device"),
        SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"),
    ):

        def full(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(store, "save_file", full)
        cache = tmp_path / f"cache-{type(error).__name__}"
        caplog.clear()
        with caplog.at_level("WARNING", logger="mergekit_darts"):
            manifest = run_surgery(
                family["merged"], block(family, cache), overwrite=True, progress=False
            )
        assert set(manifest["tasks"]) == {"math", "math_ewl1", "code"}
        warnings = [r.getMessage() for r in caplog.records if "capture store" in r.getMessage()]
        assert len(warnings) == 1 and "going on without the disk store" in warnings[0]
        assert "\n" not in warnings[0]
        assert not list(cache.rglob("*.safetensors")) and not list(cache.rglob(".*tmp*"))


def test_a_refused_block_leaves_no_cache_dir_behind(family, tmp_path):
    """cache_dir is made by the first entry written, not by the checks."""
    from click.testing import CliRunner

    from mergekit_darts.cli import main
    from mergekit_darts.errors import SurgeryConfigError

    cache = tmp_path / "new" / "cache"
    config = block(family, cache)
    config["tasks"][0]["calibration"]["path"] = str(tmp_path / "missing.jsonl")
    with pytest.raises(SurgeryConfigError, match="missing.jsonl"):
        run_surgery(family["merged"], config, progress=False)
    assert not (tmp_path / "new").exists()
    path = tmp_path / "surgery.yml"
    path.write_text(json.dumps({**config, "cache_dir": None}))
    args = ["calibrate", str(family["merged"]), str(path), "--quiet", "--cache-dir", str(cache)]
    run = CliRunner().invoke(main, args)
    assert run.exit_code != 0 and "missing.jsonl" in run.output
    assert not (tmp_path / "new").exists()
