"""The post-merge step end to end: the stock `mergekit-yaml` console script (through the startup
hook) and `mergekit-darts merge|calibrate`, on tiny real models, for every tested merge method;
plus the resource contract, determinism and failure atomicity of `run_surgery`."""

from __future__ import annotations

import gc
import inspect
import json
import shutil
import subprocess
import sys
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import chdir
from dataclasses import dataclass
from pathlib import Path

import mergekit.merge
import pytest
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from safetensors.torch import load_file
from tiny import (
    BIN,
    METHODS,
    ONE_TASK,
    SURGERY,
    hooked_merge,
    merge_recipe,
    merge_yaml,
    script_env,
)
from transformers import AutoModelForCausalLM

from mergekit_darts import load_surgery, run_surgery
from mergekit_darts.errors import SurgeryConfigError, SurgeryFormatError, SurgeryRunError
from mergekit_darts.hosts.mergekit.hook import merge_with_surgery, refuse_unread_block

# Stock flags that must keep working next to the surgery block (mergekit's own options).
FLAGS = {
    "ties": ["--lazy-unpickle"],
    "dare_ties": ["--random-seed", "1"],
    "dare_linear": ["--random-seed", "1", "--out-shard-size", "1B"],
    "slerp": ["--allow-crimes", "--copy-tokenizer"],
}
VIA_DARTS_CLI = "della"  # the one method run through `mergekit-darts merge`


@dataclass
class Run:
    done: subprocess.CompletedProcess
    out: Path

    def check(self) -> None:
        assert self.done.returncode == 0, self.done.stderr[-3000:]

    @property
    def manifest(self) -> dict:
        return json.loads((self.out / "surgery" / "manifest.json").read_text())


@pytest.fixture(scope="module")
def runs(workdir, tiny_merged) -> dict[str, Run]:
    """Every console-script run of this module, two at a time (they are import-bound)."""
    jobs: dict[str, tuple[list[str], dict[str, str], Path]] = {}

    def job(name: str, yaml_text: str, command: list[str], **env_changes: str) -> Path:
        """Queue ``command`` (``merge.yml`` / ``out`` name files of the job's own folder)."""
        folder = workdir / "runs" / name
        folder.mkdir(parents=True)
        (folder / "merge.yml").write_text(yaml_text)
        named = {"merge.yml": str(folder / "merge.yml"), "out": str(folder / "out")}
        argv = [str(BIN / command[0]), *(named.get(arg, arg) for arg in command[1:])]
        jobs[name] = (argv, script_env(**env_changes), folder / "out")
        return folder / "out"

    def stale_surgery(out: Path) -> None:
        (out / "surgery").mkdir(parents=True)
        (out / "surgery" / "stale.txt").write_text("from an older run")

    yaml_cli = ["mergekit-yaml", "merge.yml", "out"]
    for method in METHODS:
        if method != VIA_DARTS_CLI:
            job(method, merge_yaml(method), yaml_cli + FLAGS.get(method, []))
    jobs["linear"][1]["DARTS_OVERWRITE_SURGERY"] = "1"  # stock command, explicit overwrite
    stale_surgery(jobs["linear"][2])
    darts_cli = ["mergekit-darts", "merge", "merge.yml", "out", "--overwrite-surgery"]
    stale_surgery(job(VIA_DARTS_CLI, merge_yaml(VIA_DARTS_CLI), darts_cli))
    job("no_hook", merge_yaml("task_arithmetic"), yaml_cli, DARTS_NO_HOOK="1")
    job("stock", merge_yaml("ties", surgery=None), yaml_cli)
    out = job(
        "calibrate", yaml.safe_dump(SURGERY), ["mergekit-darts", "calibrate", "out", "merge.yml"]
    )
    shutil.copytree(tiny_merged, out)

    def launch(name: str) -> tuple[str, Run]:
        command, environment, out = jobs[name]
        done = subprocess.run(
            command, cwd=workdir, env=environment, capture_output=True, text=True, timeout=600
        )
        return name, Run(done, out)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(launch, list(jobs)))


# ---- the console scripts -------------------------------------------------------------------------


def assert_surgery(run: Run) -> None:
    run.check()
    manifest = run.manifest
    assert manifest["format"] == "darts-surgery"
    assert manifest["hidden_size"] == 64 and manifest["vocab_size"] == 65
    assert set(manifest["tasks"]) == {"math", "code"}
    for name, entry in manifest["tasks"].items():
        assert entry["metrics"]["rho_l1"] > 0, (name, entry["metrics"])
        assert entry["steps"] == 20 and len(entry["calibration"]["prompt_sha256"]) == 6
        module = load_surgery(run.out / "surgery", name)
        assert module.kind == entry["module"] == "pos_corr"
    assert manifest["tasks"]["code"]["calibration"]["completion_tokens"]
    assert manifest["tasks"]["math"]["eval_tasks"] == ["tiny_math"]
    readme = (run.out / "README.md").read_text()
    assert readme.count("## DARTS surgery") == 1 and "surgery=math" in readme
    assert not list(run.out.glob(".surgery*")), "no staging folder left behind"


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_every_merge_method(runs, method):
    run = runs[method]
    assert_surgery(run)
    config = yaml.safe_load((run.out / "mergekit_config.yml").read_text())
    assert config["surgery"] == SURGERY, "the merge YAML keeps its surgery block"
    surgery_yml = yaml.safe_load((run.out / "surgery" / "surgery.yml").read_text())
    assert surgery_yml == {"surgery": SURGERY}
    assert "DARTS surgery" in run.done.stdout and "ρ_L1" in run.done.stdout  # the summary table


@pytest.mark.slow
def test_overwrite_flags_replace_an_old_surgery_folder(runs):
    for name in (VIA_DARTS_CLI, "linear"):  # --overwrite-surgery; DARTS_OVERWRITE_SURGERY=1
        assert_surgery(runs[name])
        assert not (runs[name].out / "surgery" / "stale.txt").exists()


@pytest.mark.slow
def test_no_hook_ignores_the_block(runs):
    run = runs["no_hook"]
    run.check()
    assert (run.out / "model.safetensors").is_file()
    assert not (run.out / "surgery").exists()
    assert "DARTS surgery" not in (run.out / "README.md").read_text()


@pytest.mark.slow
def test_yaml_without_surgery_is_stock(runs, tmp_path):
    """With the hook installed, a YAML without `surgery:` gives what stock mergekit gives."""
    hooked = runs["stock"]
    hooked.check()
    source = (hooked.out.parent / "merge.yml").read_text()
    stock = tmp_path / "out"
    with chdir(hooked.out.parent.parent.parent):  # the workdir: ./base, ./math, ./code
        inspect.unwrap(mergekit.merge.run_merge)(
            MergeConfiguration.model_validate(yaml.safe_load(source)),
            str(stock),
            options=MergeOptions(quiet=True),
            config_source=source,
        )
    files = sorted(p.name for p in hooked.out.iterdir())
    assert files == sorted(p.name for p in stock.iterdir())
    assert "surgery" not in files
    for name in files:
        ours, theirs = (hooked.out / name).read_bytes(), (stock / name).read_bytes()
        if name == "README.md":  # mergekit lists the models in set order, which may vary
            ours, theirs = sorted(ours.splitlines()), sorted(theirs.splitlines())
        assert ours == theirs, name


@pytest.mark.slow
def test_calibrate_an_existing_merge(runs, tiny_merged):
    run = runs["calibrate"]
    assert_surgery(run)
    for name in ("model.safetensors", "config.json", "mergekit_config.yml"):
        assert (run.out / name).read_bytes() == (tiny_merged / name).read_bytes()
    assert yaml.safe_load((run.out / "surgery" / "surgery.yml").read_text()) == {"surgery": SURGERY}


# ---- run_surgery in process ----------------------------------------------------------------------


def absolute(surgery: dict, root: Path) -> dict:
    """The module's SURGERY block with its paths made absolute (in-process tests keep the cwd)."""
    block = json.loads(json.dumps(surgery))
    for entry in block["tasks"]:
        entry["target"] = str(root / entry["target"])
        entry["calibration"]["path"] = str(root / entry["calibration"]["path"])
    return block


@pytest.mark.slow
def test_tasks_cost_one_load_per_distinct_model_one_at_a_time(
    workdir, merged_copy, monkeypatch, capsys
):
    block = absolute(SURGERY, workdir)
    third = json.loads(json.dumps(block["tasks"][0]))
    third.update(name="math_generated", eval_tasks=["tiny_math_gen"])
    third["calibration"]["continuation_tokens"] = 4
    block["tasks"].append(third)
    loaded: list[str] = []
    alive: list[weakref.ref] = []
    original = AutoModelForCausalLM.from_pretrained

    def counting(path, *args, **kwargs):
        gc.collect()
        assert not [ref for ref in alive if ref() is not None], "two models in memory at once"
        loaded.append(Path(path).name)
        model = original(path, *args, **kwargs)
        alive.append(weakref.ref(model))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counting)
    manifest = run_surgery(merged_copy, block)
    # math_generated shares its target with math: loaded once for both (distinct targets + 1)
    assert loaded == ["math", "code", "merged"], "targets first, then the merge once"
    assert set(manifest["tasks"]) == {"math", "code", "math_generated"}
    table = capsys.readouterr().out
    assert "math_generated" in table and "ρ_L1" in table


@pytest.mark.slow
def test_same_config_and_seed_give_identical_bytes(workdir, tiny_merged, tmp_path):
    block = absolute(SURGERY, workdir)
    outputs = []
    for name in ("a", "b"):
        merged = Path(shutil.copytree(tiny_merged, tmp_path / name))
        run_surgery(merged, block, progress=False)
        outputs.append(merged / "surgery")
    files = sorted(p.relative_to(outputs[0]) for p in outputs[0].rglob("*.safetensors"))
    assert len(files) == 4  # two modules, two diagnostics
    for file in files:
        assert (outputs[0] / file).read_bytes() == (outputs[1] / file).read_bytes(), file


@pytest.mark.slow
def test_manifest_and_diagnostics(workdir, merged_copy):
    manifest = run_surgery(merged_copy, absolute(SURGERY, workdir), progress=False)
    assert set(manifest["versions"]) == {"mergekit-darts", "mergekit", "torch", "transformers"}
    assert {"load_merged_s", "total_s"} <= set(manifest["timings"])
    code = manifest["tasks"]["code"]
    assert {
        "load_target_s",
        "generate_s",
        "capture_target_s",
        "capture_merged_s",
        "train_s",
    } <= set(code["timings"])
    metrics = code["metrics"]
    assert metrics["delta_after"] < metrics["delta_before"]
    assert metrics["rho_l1"] == pytest.approx(1 - metrics["delta_after"] / metrics["delta_before"])
    assert len(metrics["loss_curve"]) == 20 and metrics["final_loss"] == metrics["loss_curve"][-1]
    diag = load_file(merged_copy / "surgery" / code["diagnostics"])
    real = diag["mask"]
    rho = 1 - diag["delta_after"][real].sum() / diag["delta_before"][real].sum()
    assert float(rho) == pytest.approx(metrics["rho_l1"], abs=1e-5)
    assert int(real.sum()) == metrics["tokens"]
    assert diag["input_ids"].shape == diag["delta_before"].shape


@pytest.mark.slow
def test_failure_with_overwrite_keeps_the_old_surgery(workdir, merged_copy):
    run_surgery(merged_copy, absolute(SURGERY, workdir), progress=False)
    before = {p: p.read_bytes() for p in merged_copy.rglob("*") if p.is_file()}
    failing = absolute(SURGERY, workdir)
    failing["tasks"][1]["target"] = str(workdir / "broken")
    with pytest.raises(SurgeryRunError) as info:
        run_surgery(merged_copy, failing, overwrite=True, progress=False)
    assert str(info.value).startswith("surgery task 'code' failed while loading target ")
    after = {p: p.read_bytes() for p in merged_copy.rglob("*") if p.is_file()}
    assert after == before


@pytest.mark.slow
def test_existing_surgery_needs_overwrite(workdir, merged_copy):
    block = absolute(SURGERY, workdir)
    run_surgery(merged_copy, block, progress=False)
    with pytest.raises(SurgeryConfigError, match="already exists: pass --overwrite-surgery"):
        run_surgery(merged_copy, block, progress=False)
    run_surgery(merged_copy, block, overwrite=True, progress=False)
    assert (merged_copy / "README.md").read_text().count("## DARTS surgery") == 1


def test_no_copy_tokenizer_is_refused_before_merging(workdir, tmp_path, monkeypatch):
    monkeypatch.chdir(workdir)
    source = merge_yaml("linear")
    with pytest.raises(SurgeryConfigError, match="--no-copy-tokenizer leaves none"):
        merge_with_surgery(
            inspect.unwrap(mergekit.merge.run_merge),
            MergeConfiguration.model_validate(yaml.safe_load(source)),
            str(tmp_path / "out"),
            MergeOptions(copy_tokenizer=False, quiet=True),
            source,
        )
    assert not (tmp_path / "out").exists()


def test_a_block_run_merge_was_not_given_stops_the_merge(workdir, tmp_path, monkeypatch):
    """A mergekit whose `mergekit-yaml` calls run_merge without the YAML text (config_source):
    the block on its command line would be skipped silently; one line instead, before merging."""
    monkeypatch.chdir(workdir)
    with_block, without = tmp_path / "with.yml", tmp_path / "without.yml"
    with_block.write_text(merge_yaml("linear"))
    without.write_text(merge_yaml("linear", None))
    out = tmp_path / "out"
    config = MergeConfiguration.model_validate(yaml.safe_load(with_block.read_text()))
    monkeypatch.setattr(sys, "argv", ["/venv/bin/mergekit-yaml", str(with_block), str(out)])
    with pytest.raises(SurgeryConfigError, match="without the YAML text") as info:
        mergekit.merge.run_merge(config, str(out), MergeOptions(quiet=True))  # the hooked one
    assert "\n" not in str(info.value) and f"calibrate OUT_PATH {with_block}" in str(info.value)
    assert not out.exists()
    # what decides: a block in a YAML of mergekit-yaml's command line, and nothing else
    refuse_unread_block(["/venv/bin/mergekit-yaml", str(without), str(out)])
    refuse_unread_block(["/venv/bin/mergekit-multi", str(with_block), "--out-path", str(out)])


@pytest.mark.slow
def test_calibrate_with_a_new_block_updates_the_recorded_recipe(workdir, tmp_path, monkeypatch):
    """After `calibrate` with another block, mergekit_config.yml and the card's copy of it show
    the block that was run (as surgery/surgery.yml does); the merge part keeps its bytes."""
    from click.testing import CliRunner

    from mergekit_darts.cli import main

    monkeypatch.chdir(workdir)
    old = yaml.safe_dump({"surgery": SURGERY}, sort_keys=False)
    models = yaml.safe_dump({"models": METHODS["linear"]["models"]}, sort_keys=False)
    source = f"# my recipe\nmerge_method: linear\n{old}\n# kept\ndtype: float32\n{models}"
    out = tmp_path / "out"
    merge_with_surgery(
        inspect.unwrap(mergekit.merge.run_merge),
        MergeConfiguration.model_validate(yaml.safe_load(source)),
        str(out),
        MergeOptions(quiet=True),
        source,
    )
    assert (out / "mergekit_config.yml").read_text() == source  # merged with its own block: as is
    new_block = {**SURGERY, "steps": 7, "tasks": SURGERY["tasks"][:1]}
    (tmp_path / "new.yml").write_text(yaml.safe_dump({"surgery": new_block}, sort_keys=False))
    done = CliRunner().invoke(
        main, ["calibrate", str(out), str(tmp_path / "new.yml"), "--overwrite", "--quiet"]
    )
    assert done.exit_code == 0, done.output
    new = yaml.safe_dump({"surgery": new_block}, sort_keys=False)
    recipe = (out / "mergekit_config.yml").read_text()
    assert recipe == source.replace(old, new)
    assert yaml.safe_load((out / "surgery" / "surgery.yml").read_text()) == {"surgery": new_block}
    readme = (out / "README.md").read_text()
    assert recipe in readme and source not in readme
    assert readme.count("## DARTS surgery") == 1


# ---- a merge into a folder that holds a surgery of other weights ----------------------------------


@pytest.mark.slow
def test_stock_remerge_sets_an_old_surgery_aside(workdir, tmp_path, monkeypatch):
    """`mergekit-yaml` without a block into a folder with surgery/: the surgery of the replaced
    weights is renamed aside (reported), and put back when the merge gives the same weights."""
    monkeypatch.chdir(workdir)
    out = tmp_path / "out"
    hooked_merge(merge_recipe("task_arithmetic", ONE_TASK), out)
    manifest = (out / "surgery" / "manifest.json").read_bytes()
    hooked_merge(merge_recipe("task_arithmetic", None), out)  # the same merge again: same weights
    assert (out / "surgery" / "manifest.json").read_bytes() == manifest
    assert sorted(p.name for p in out.glob("surgery*")) == ["surgery"]
    load_surgery(out / "surgery")

    (tmp_path / "other.yml").write_text(merge_yaml("linear", surgery=None))
    done = subprocess.run(
        [str(BIN / "mergekit-yaml"), str(tmp_path / "other.yml"), str(out)],
        cwd=workdir,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (aside,) = out.glob("surgery.set-aside-*")
    assert f"{out / 'surgery'} was calibrated on the weights this merge replaces" in done.stderr
    assert f"moved to {aside}" in done.stderr
    assert not (out / "surgery").exists()
    assert (aside / "manifest.json").read_bytes() == manifest  # nothing deleted
    with pytest.raises(SurgeryFormatError, match="was calibrated on other weights"):
        load_surgery(aside, weights=out)


@pytest.mark.slow
def test_a_failure_after_the_merge_says_what_was_written(workdir, tmp_path, monkeypatch):
    """With the overwrite flag and a target that cannot load, the merge is written: the message
    says so, and where the previous surgery (of the replaced weights) went."""
    monkeypatch.chdir(workdir)
    out = tmp_path / "out"
    hooked_merge(merge_recipe("task_arithmetic", ONE_TASK), out)
    manifest = (out / "surgery" / "manifest.json").read_bytes()
    failing = {**ONE_TASK, "tasks": [{**ONE_TASK["tasks"][0], "target": "./broken"}]}
    with pytest.raises(SurgeryRunError) as info:
        hooked_merge(merge_recipe("linear", failing), out, overwrite=True)
    (aside,) = out.glob("surgery.set-aside-*")
    message = str(info.value)
    assert "unchanged" not in message and "\n" not in message
    assert message.startswith("surgery task 'math' failed while loading target ")
    assert message.endswith(
        f"; the merge was written to {out} (weights and recipe) and the previous surgery/ is "
        f"at {aside} (calibrated on the weights it replaced)"
    )
    assert (aside / "manifest.json").read_bytes() == manifest and not (out / "surgery").exists()
    assert yaml.safe_load((out / "mergekit_config.yml").read_text())["merge_method"] == "linear"

    with pytest.raises(SurgeryRunError) as info:  # the same merge again: nothing is set aside
        hooked_merge(merge_recipe("linear", failing), out, overwrite=True)
    assert str(info.value).endswith(
        f"; the merge was written to {out} (weights and recipe) and it has no surgery/"
    )


@pytest.mark.slow
def test_calibrate_does_not_invalidate_its_own_captures(workdir, tmp_path, monkeypatch):
    """`calibrate` records its block in mergekit_config.yml; the capture store's key of the merged
    model leaves that file out, so the next `calibrate --overwrite` loads no model at all."""
    from click.testing import CliRunner

    from mergekit_darts.cli import main

    monkeypatch.chdir(workdir)
    out = tmp_path / "out"
    cached = {**ONE_TASK, "cache_dir": str(tmp_path / "cache")}
    hooked_merge(merge_recipe("task_arithmetic", cached), out)
    for steps in (3, 4):  # each run records another block in the recipe
        block = tmp_path / f"steps{steps}.yml"
        block.write_text(yaml.safe_dump({"surgery": {**cached, "steps": steps}}))
        done = CliRunner().invoke(
            main, ["calibrate", str(out), str(block), "--overwrite", "--quiet"]
        )
        assert done.exit_code == 0, done.output
        recipe = yaml.safe_load((out / "mergekit_config.yml").read_text())
        assert recipe["surgery"]["steps"] == steps
        manifest = json.loads((out / "surgery" / "manifest.json").read_text())
        assert manifest["captures"]["model_loads"] == 0, (steps, manifest["captures"])
