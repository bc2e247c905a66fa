"""A 2 x 2 x 2-seed sweep on the tiny models completes, and resumes after a kill without redoing cells."""

from __future__ import annotations

import contextlib
import csv
import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from lm_eval.tasks import TaskManager
from tiny import EVAL_TASKS

from mergekit_darts.analysis import sweep
from mergekit_darts.analysis.sweep import cell as sweep_cell
from mergekit_darts.analysis.sweep.cell import tasks_identity
from mergekit_darts.cli.sweep import command as sweep_command
from mergekit_darts.errors import SurgeryConfigError


class Counting:
    """Wraps a sweep step, counts calls, and can fail on the n-th call (a simulated kill)."""

    def __init__(self, fn, fail_on: int | None = None):
        self.fn, self.fail_on, self.calls = fn, fail_on, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_on:
            raise KeyboardInterrupt("simulated kill")
        return self.fn(*args, **kwargs)


@pytest.mark.slow
def test_sweep_completes_and_resumes_after_a_kill(spec_file, monkeypatch):
    spec = sweep.load_spec(spec_file)
    output = sweep.output_dir(spec, spec_file)
    # baseline + 2 cells finish, the 3rd dies
    evaluate = Counting(sweep_cell.score_surgery, fail_on=4)
    monkeypatch.setattr(sweep_cell, "score_surgery", evaluate)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(spec, output)
    finished = sorted(output.glob("cells/*/result.json"))
    assert [p.parent.name for p in finished] == [
        "module-standard__loss-l1__seed-0",
        "module-standard__loss-l1__seed-1",
        "surgery-none",
    ]
    stamps = {p: p.stat().st_mtime_ns for p in finished}
    assert not (output / "cells" / "module-standard__loss-ewl1__seed-0" / "result.json").exists()

    evaluate = Counting(evaluate.fn)
    calibrate = Counting(sweep_cell.cell_surgery)
    monkeypatch.setattr(sweep_cell, "score_surgery", evaluate)
    monkeypatch.setattr(sweep_cell, "cell_surgery", calibrate)
    run = CliRunner().invoke(sweep_command, [str(spec_file)])
    assert run.exit_code == 0, run.output
    assert evaluate.calls == 6 and calibrate.calls == 6  # only the 6 unfinished surgery cells
    assert {p: p.stat().st_mtime_ns for p in finished} == stamps
    assert "finished earlier, skipped" in run.output

    results = json.loads((output / "results.json").read_text())
    assert len(results["cells"]) == 9 and results["axes"] == ["module", "loss"]
    for cell in results["cells"]:
        assert set(cell["scores"]) == set(EVAL_TASKS)
        assert all(len(cell["items"][t]) == 4 for t in EVAL_TASKS)  # per-item scores, limit 4
        if cell["settings"] != {"surgery": "none"}:
            assert set(cell["rho_l1"]) == {"math"}
            assert cell["eval_rho"] == dict.fromkeys(EVAL_TASKS, cell["rho_l1"]["math"])

    markdown = (output / "results.md").read_text()
    assert "| module | loss | sweep_a | sweep_b | Avg. | ρ_L1 (%) |" in markdown
    assert "| none (no surgery) | — |" in markdown
    assert markdown.count("| pos_corr | ewl1 |") == 1 and " ± " in markdown
    with (output / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 9 and {r["seed"] for r in rows} == {"", "0", "1"}
    assert (output / "rho_vs_score.png").read_bytes()[:4] == b"\x89PNG"
    assert "Paired tests over seeds (Table 15)" in (output / "stats.md").read_text()


def test_a_changed_spec_reruns_a_cell_instead_of_reusing_it(spec_file):
    spec = sweep.load_spec(spec_file)
    (settings, block), *_ = sweep.plan(spec)[1:]
    changed = sweep.cell_block(block, {"steps": 4})
    assert sweep.fingerprint("m", block, {}) != sweep.fingerprint("m", changed, {})
    assert sweep.fingerprint("m", block, {}) == sweep.fingerprint("m", dict(block), {})


@pytest.mark.slow
def test_a_cell_is_redone_when_its_merge_target_or_calibration_changes(
    spec_file, tiny_family, tmp_path, monkeypatch
):
    """Resume trusts content, not paths: other weights merged into the same `merged:` folder (or
    an edited calibration file) rerun the cell instead of keeping its old numbers."""
    import inspect

    import mergekit.merge
    from mergekit.config import MergeConfiguration
    from mergekit.options import MergeOptions

    data = yaml.safe_load(spec_file.read_text())
    merged = Path(shutil.copytree(data["merged"], tmp_path / "merged"))
    calib = Path(shutil.copy(data["surgery"]["tasks"][0]["calibration"]["path"], tmp_path))
    data["surgery"]["tasks"][0]["calibration"]["path"] = str(calib)
    data.pop("compare")
    data |= {"merged": str(merged), "output": str(tmp_path / "out"), "baseline": False}
    data["grid"] = {"seed": [0]}
    path = tmp_path / "sweep.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    calibrate = Counting(sweep_cell.cell_surgery)
    monkeypatch.setattr(sweep_cell, "cell_surgery", calibrate)

    def run() -> dict:
        (record,) = sweep.run_sweep(sweep.load_spec(path), tmp_path / "out")
        return record

    first = run()
    assert run() == first and calibrate.calls == 1  # unchanged: skipped
    config = MergeConfiguration.model_validate(
        {
            "merge_method": "linear",
            "models": [
                {"model": str(tiny_family.math), "parameters": {"weight": 0.9}},
                {"model": str(tiny_family.code), "parameters": {"weight": 0.1}},
            ],
            "dtype": "float32",
        }
    )
    inspect.unwrap(mergekit.merge.run_merge)(config, str(merged), MergeOptions(quiet=True))
    redone = run()
    assert calibrate.calls == 2 and redone["fingerprint"] != first["fingerprint"]
    assert redone["rho_l1"] != first["rho_l1"]  # the new weights' numbers, not the old ones
    calib.write_text(calib.read_text().replace("two", "six"))
    assert run()["fingerprint"] != redone["fingerprint"] and calibrate.calls == 3


def test_cell_block_sets_grid_values_on_every_task():
    base = {"module": "pos_corr", "tasks": [{"name": "a", "module": "add", "calibration": {}}]}
    block = sweep.cell_block(
        base, {"module": "standard", "num_samples": 7, "cache_dtype": "float32"}
    )
    assert block["tasks"][0]["module"] == "standard"
    assert block["tasks"][0]["calibration"]["num_samples"] == 7
    assert block["cache_dtype"] == "float32" and base["tasks"][0]["module"] == "add"
    cells = sweep.cells({"rank": [4, 8], "seed": [0, 1, 2]})
    assert len(cells) == 6 and cells[1] == {"rank": 4, "seed": 1}
    assert sweep.cell_id(cells[1]) == "rank-4__seed-1"


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"grid": {"lr": ["1e-3", "fast"]}}, "sweep.grid.lr[1]: input should be a valid number"),
        ({"grid": {"colour": [1]}}, "sweep.grid.colour: cannot be swept"),
        ({"grid": {"seed": []}}, "sweep.grid.seed: expected a non-empty list"),
        ({"eval": {"tasks": ["a"], "limt": 3}}, "sweep.eval.limt: unknown key; allowed: tasks"),
        ({"merged": 3}, "sweep.merged: input should be a valid string"),
        ({"merged": None}, "sweep: give `merged: PATH` (one merged model) or `merges:"),
        ({"merges": ["a.yml"]}, "sweep: give `merged: PATH` (one merged model) or `merges:"),
        ({"merged": None, "merges": []}, "sweep.merges: list should have at least 1 item"),
    ],
)
def test_spec_errors_name_the_key(tmp_path, patch, message):
    spec = {"merged": "m", "surgery": "s.yml", "grid": {"seed": [0]}, "eval": {"tasks": ["a"]}}
    path = tmp_path / "sweep.yml"
    path.write_text(yaml.safe_dump({**spec, **patch}))
    with pytest.raises(SurgeryConfigError) as err:
        sweep.load_spec(path)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_invalid_cell_is_reported_before_anything_runs(spec_file, tmp_path):
    spec = yaml.safe_load(spec_file.read_text())
    spec["grid"] = {"max_length": [8, 64]}
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SurgeryConfigError, match=r"sweep cell max_length-64: surgery\.tasks\[0\]"):
        sweep.plan(sweep.load_spec(path))


def test_eval_task_without_a_module_is_reported_before_anything_runs(spec_file, tmp_path):
    spec = yaml.safe_load(spec_file.read_text())
    spec["eval"]["tasks"] = [*EVAL_TASKS, "sweep_other"]
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SurgeryConfigError, match="no surgery task serves 'sweep_other'"):
        sweep.plan(sweep.load_spec(path))
    spec["eval"]["surgery_map"] = "sweep_a:math;sweep_b:math;sweep_other:none"
    path.write_text(yaml.safe_dump(spec))
    assert len(sweep.plan(sweep.load_spec(path))) == 9


def test_lr_given_as_yaml_string_is_read_as_a_number(tmp_path):
    path = tmp_path / "sweep.yml"
    path.write_text("merged: m\nsurgery: s.yml\neval: {tasks: [a]}\ngrid: {lr: [1e-3, 5e-4]}\n")
    assert sweep.load_spec(path).grid == {"lr": [1e-3, 5e-4]}


# --- calibrate once, train many --------------------------------------------------------------


@pytest.fixture
def loads(monkeypatch) -> Counter:
    """Folder names of every model ``from_pretrained`` loads, capture or lm-eval (real calls);
    fails if a model is loaded while another is still alive (one full model at a time)."""
    import gc
    import weakref

    from transformers import AutoModelForCausalLM

    loaded: Counter = Counter()
    alive: list[weakref.ref] = []
    original = AutoModelForCausalLM.from_pretrained

    def counting(path, *args, **kwargs):
        gc.collect()
        assert not [ref for ref in alive if ref() is not None], "two models in memory at once"
        loaded[Path(str(path)).name] += 1
        model = original(path, *args, **kwargs)
        alive.append(weakref.ref(model))
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", counting)
    return loaded


def two_task_spec(spec_file, tiny_family, tmp_path, **changes) -> Path:
    """The module's spec with a `code` task next to `math`: 4 surgery cells, 2 targets."""
    spec = yaml.safe_load(spec_file.read_text())
    math = spec["surgery"]["tasks"][0]
    math["eval_tasks"] = ["sweep_a"]
    code = {**math, "name": "code", "target": str(tiny_family.code), "eval_tasks": ["sweep_b"]}
    spec["surgery"]["tasks"].append(code)
    spec["grid"] = {"module": ["standard", "pos_corr"], "loss": ["l1", "ewl1"]}
    spec.pop("compare")
    spec.update(output=str(tmp_path / "out"), **changes)
    path = tmp_path / "sweep.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@pytest.mark.slow
def test_four_cells_two_tasks_cost_four_loads_and_a_warm_store_loads_no_target(
    spec_file, tiny_family, tmp_path, loads
):
    from mergekit_darts.calibrate.store import CaptureStore

    path = two_task_spec(spec_file, tiny_family, tmp_path)
    spec = sweep.load_spec(path)
    cache = tmp_path / "cache"
    first = sweep.run_sweep(spec, tmp_path / "out", CaptureStore(cache))
    assert len(first) == 5  # baseline + 4 cells
    # capture: math, code and the merge (through a cell's linked folder, "model") once each;
    # evaluation: one hf-darts model of the merge for all 5 cells
    assert loads == Counter({"math": 1, "code": 1, "model": 1, "merged": 1})
    loads.clear()
    second = sweep.run_sweep(spec, tmp_path / "again", CaptureStore(cache))  # every cell reruns
    assert loads == Counter({"merged": 1})  # no target, no capture load: only evaluation's
    for a, b in zip(first, second, strict=True):
        assert (a["cell"], a["scores"], a["items"], a["rho_l1"]) == (
            b["cell"],
            b["scores"],
            b["items"],
            b["rho_l1"],
        )


@pytest.mark.slow
def test_swapping_modules_scores_like_a_fresh_model_per_cell(spec_file, tiny_family, tmp_path):
    """One model with its modules swapped between cells gives each cell's own fresh scores."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    path = two_task_spec(spec_file, tiny_family, tmp_path)
    spec = sweep.load_spec(path)
    records = sweep.run_sweep(spec, tmp_path / "out")
    manager = TaskManager(include_path=spec.eval.include_path, include_defaults=False)
    for record in (records[0], records[-1]):  # the baseline, then the last cell
        folder = tmp_path / "out" / "cells" / record["cell"] / "model" / "surgery"
        surgery = (
            {"surgery": "none"}
            if record["cell"] == "surgery-none"
            else {
                "surgery": "auto",
                "surgery_path": str(folder),
            }
        )
        fresh = lm_eval.simple_evaluate(
            model="hf-darts",
            model_args={"pretrained": spec.merged, "dtype": "float32", **surgery},
            tasks=list(EVAL_TASKS),
            limit=spec.eval.limit,
            batch_size=spec.eval.batch_size,
            device="cpu",
            log_samples=True,
            bootstrap_iters=0,
            task_manager=manager,
        )
        assert sweep.scores_of(fresh, spec.eval)["items"] == record["items"], record["cell"]


def merge_yamls(tiny_family, folder) -> list[str]:
    folder.mkdir()
    experts = [{"model": str(tiny_family.math)}, {"model": str(tiny_family.code)}]
    configs = {
        "linear": {"merge_method": "linear", "models": experts},
        "task_arithmetic": {"merge_method": "task_arithmetic", "base_model": str(tiny_family.base)},
        "dare_linear": {"merge_method": "dare_linear", "base_model": str(tiny_family.base)},
    }
    paths = []
    for name, config in configs.items():
        if name != "linear":
            config["models"] = [
                {**e, "parameters": {"weight": 0.5, "density": 0.5}} for e in experts
            ]
        else:
            config["models"] = [{**e, "parameters": {"weight": 0.5}} for e in experts]
        config |= {"dtype": "float32", "surgery": {"tasks": "ignored: the sweep's grid runs"}}
        (folder / f"{name}.yml").write_text(yaml.safe_dump(config))
        paths.append(str(folder / f"{name}.yml"))
    return paths


@pytest.mark.slow
def test_merge_grid_captures_targets_once_and_marks_the_best_merge(
    spec_file, tiny_family, tmp_path, loads
):
    yamls = merge_yamls(tiny_family, tmp_path / "merges")
    spec_data = yaml.safe_load(spec_file.read_text())
    spec_data.pop("merged")
    spec_data.pop("compare")
    spec_data |= {"merges": yamls, "grid": {"module": ["standard", "pos_corr"]}}
    spec_data["output"] = str(tmp_path / "out")
    path = tmp_path / "grid.yml"
    path.write_text(yaml.safe_dump(spec_data, sort_keys=False))
    run = CliRunner().invoke(sweep_command, [str(path)])
    assert run.exit_code == 0, run.output
    # K + M capture loads (math once, each merge once through a cell folder) + M evaluation models
    assert loads == Counter(
        {"math": 1, "model": 3, "linear": 1, "task_arithmetic": 1, "dare_linear": 1}
    )
    out = tmp_path / "out"
    assert all((out / "merges" / n / "config.json").is_file() for n in ("linear", "dare_linear"))
    assert not (
        out / "merges" / "dare_linear" / "surgery"
    ).exists()  # the YAML's own block is not run

    results = json.loads((out / "results.json").read_text())
    assert len(results["cells"]) == 9 and results["axes"] == ["merge", "module"]
    expected = {}  # the best merge per method, from the cells, independently of the code
    for cell in results["cells"]:
        settings = dict(cell["settings"])
        merge = settings.pop("merge")
        method = "surgery=none" if settings.get("surgery") else f"module={settings['module']}"
        avg = sum(cell["scores"].values()) / len(cell["scores"])
        if method not in expected or avg > expected[method][0]:
            expected[method] = (avg, merge)
    assert results["best_merge"] == {m: merge for m, (_, merge) in expected.items()}
    markdown = (out / "results.md").read_text()
    assert "| merge | module | sweep_a | sweep_b | Avg. | ρ_L1 (%) |" in markdown
    assert markdown.count("★ |") == 3 and "## Best merge per method" in markdown
    table = markdown.split("## Best merge")[0]
    for name in ("linear", "task_arithmetic", "dare_linear"):
        assert table.count(f"| {name}") == 3  # baseline + 2 modules, each naming its merge
    assert "| none (no surgery) |" in markdown

    loads.clear()
    again = CliRunner().invoke(sweep_command, [str(path)])
    assert again.exit_code == 0, again.output
    assert not loads and again.output.count("done earlier, kept") == 3  # resumed: nothing redone


def test_merge_grid_errors_before_any_merge(spec_file, tmp_path):
    spec = yaml.safe_load(spec_file.read_text())
    spec.pop("merged")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "m.yml").write_text("merge_method: linear\nmodels: []\n")
    (tmp_path / "m.yml").write_text("merge_method: nope\n")
    spec["merges"] = [str(tmp_path / "a" / "m.yml"), str(tmp_path / "m.yml")]
    path = tmp_path / "grid.yml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SurgeryConfigError, match=r"sweep.merges\[1\]: .* share the name 'm'"):
        sweep.run_sweep(sweep.load_spec(path), tmp_path / "out")
    spec["merges"] = [str(tmp_path / "m.yml")]
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SurgeryConfigError, match=r"sweep.merges\[0\]: .* is not a mergekit config"):
        sweep.run_sweep(sweep.load_spec(path), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_merged_folder_holding_two_merges_is_refused_before_anything_runs(spec_file, tmp_path):
    """transformers would load the single file and never the shards beside it: which merge the
    cells fit cannot be told, so none runs."""
    spec = yaml.safe_load(spec_file.read_text())
    merged = Path(shutil.copytree(spec["merged"], tmp_path / "merged"))
    shutil.copy(merged / "model.safetensors", merged / "model-00001-of-00002.safetensors")
    spec |= {"merged": str(merged), "output": str(tmp_path / "out")}
    path = tmp_path / "sweep.yml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SurgeryConfigError) as info:
        sweep.run_sweep(sweep.load_spec(path), tmp_path / "out")
    message = str(info.value)
    assert message.startswith(f"sweep.merged: {merged} holds two merges"), message
    assert "model-00001-of-00002.safetensors" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


def test_best_merge_is_the_highest_mean_average_per_method():
    def cell(merge, module, seed, a, b):
        settings = {"merge": merge, "module": module, "seed": seed}
        return {"cell": f"{merge}-{module}-{seed}", "settings": settings, "rho_l1": {}}, (a, b)

    raw = [
        cell("ties", "standard", 0, 40, 42),
        cell("ties", "standard", 1, 44, 40),  # mean avg 41.5
        cell("dare", "standard", 0, 43, 41),
        cell("dare", "standard", 1, 40, 41),  # mean avg 41.25
        cell("ties", "pos_corr", 0, 30, 30),
        cell("dare", "pos_corr", 0, 31, 30),
    ]
    records = [{**r, "scores": {"a": a, "b": b}} for r, (a, b) in raw]
    records.append(
        {
            "cell": "dare-none",
            "settings": {"merge": "dare", "surgery": "none"},
            "scores": {"a": 1.0, "b": 2.0},
            "rho_l1": {},
        }
    )
    rows = sweep.config_rows(records, ["a", "b"])
    best = {sweep.method_label(r["config"]): r["config"]["merge"] for r in rows if r["best"]}
    assert best == {"module=standard": "ties", "module=pos_corr": "dare", "surgery=none": "dare"}
    markdown = sweep.results_markdown(records, ["a", "b"])
    assert "| ties ★ | standard | 42.0 ± 2.8 | 41.0 ± 1.4 | 41.5 ± 0.7 |" in markdown
    assert "| dare | standard |" in markdown and "| dare ★ | none (no surgery) |" in markdown


# ------------------------------------------------------------------------------------------------
# A sweep re-run after an eval task's files changed scores its cells again.
#
# The cell fingerprint holds what lm-eval reads for the eval tasks by content (each config with the
# YAMLs it includes, the data files, folders and ``!function`` modules it names), not only their
# names: an edited data file or task YAML reruns the cells instead of keeping the old scores. An
# ``hf-darts`` argument that changes the merged weights (``peft=``, ``delta=``) is refused up front.


def one_choice_thrice(data: Path) -> None:
    """Every item's choices made the same, the answer first: each item scores 100 (ties go to
    the first choice)."""
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    lines = [json.dumps(row | {"choices": [row["choices"][0]] * 3, "answer": 0}) for row in rows]
    data.write_text("\n".join(lines) + "\n")


@pytest.mark.slow
def test_a_changed_task_file_rescores_the_cells(
    spec_file: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = yaml.safe_load(spec_file.read_text())
    tasks = Path(shutil.copytree(data["eval"]["include_path"], tmp_path / "tasks"))
    items = tasks / "items.jsonl"
    for name in EVAL_TASKS:  # the copied YAMLs read the copied data
        path = tasks / f"{name}.yaml"
        config = yaml.safe_load(path.read_text())
        config["dataset_kwargs"]["data_files"]["test"] = str(items)
        path.write_text(yaml.safe_dump(config))
    data.pop("compare")
    data["eval"]["include_path"] = str(tasks)
    data |= {"output": str(tmp_path / "out"), "baseline": False, "grid": {"seed": [0]}}
    path = tmp_path / "sweep.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    evaluate = Counting(sweep_cell.score_surgery)
    monkeypatch.setattr(sweep_cell, "score_surgery", evaluate)

    def run(output: str = "out") -> dict:
        (record,) = sweep.run_sweep(sweep.load_spec(path), tmp_path / output)
        return record

    first = run()
    assert run() == first and evaluate.calls == 1  # unchanged: skipped
    one_choice_thrice(items)
    changed = run()
    assert evaluate.calls == 2 and first["scores"] != changed["scores"] == dict.fromkeys(
        EVAL_TASKS, 100.0
    )
    assert changed["scores"] == run("fresh")["scores"]  # what a fresh sweep scores now
    yaml_file = tasks / f"{EVAL_TASKS[0]}.yaml"
    yaml_file.write_text(yaml_file.read_text().replace("'{{q}}'", "'{{q}} ?'"))
    assert run()["fingerprint"] != changed["fingerprint"] and evaluate.calls == 4


def folder_listing(folder: Path) -> dict[str, str]:
    """Relative path -> link target or file bytes' sha256 of everything under ``folder`` (the
    manifest only named: it records timings)."""
    import hashlib

    found = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_symlink():
            found[name] = "-> " + str(path.readlink())
        elif path.name == "manifest.json":
            found[name] = "manifest"
        elif path.is_file():
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.mark.slow
def test_a_rerun_cell_replaces_its_folder_and_its_scores(
    spec_file: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A merge made by ``mergekit-yaml`` with a block keeps it in ``mergekit_config.yml``, and
    each cell records its own block there (a file, no longer a link): a cell rerun after its task
    data changed is written as a first run would write it, and results.md shows the new scores."""
    data = yaml.safe_load(spec_file.read_text())
    merged = Path(shutil.copytree(data["merged"], tmp_path / "merged"))
    recipe = merged / "mergekit_config.yml"
    recipe.write_text(f"{recipe.read_text()}\n{yaml.safe_dump({'surgery': data['surgery']})}")
    tasks = Path(shutil.copytree(data["eval"]["include_path"], tmp_path / "tasks"))
    items = tasks / "items.jsonl"
    for name in EVAL_TASKS:  # the copied YAMLs read the copied data
        path = tasks / f"{name}.yaml"
        config = yaml.safe_load(path.read_text())
        config["dataset_kwargs"]["data_files"]["test"] = str(items)
        path.write_text(yaml.safe_dump(config))
    data.pop("compare")
    data["eval"]["include_path"] = str(tasks)
    data |= {"merged": str(merged), "baseline": False, "grid": {"seed": [0]}}
    path = tmp_path / "sweep.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))

    def run(output: str) -> tuple[Path, str]:
        written = sweep.run_spec_file(path, output=tmp_path / output)
        (cell,) = (tmp_path / output / "cells").iterdir()
        return cell, written["markdown"].read_text()

    cell, first = run("out")
    assert not (cell / "model" / "mergekit_config.yml").is_symlink()  # the cell's own block
    one_choice_thrice(items)
    cell, markdown = run("out")
    assert markdown != first and "| 100.0 | 100.0 | 100.0 |" in markdown, markdown
    fresh, fresh_markdown = run("fresh")
    assert markdown == fresh_markdown
    assert folder_listing(cell / "model") == folder_listing(fresh / "model")
    assert sorted(p.name for p in cell.parent.iterdir()) == [cell.name]  # nothing left beside it


EDITS = [  # file, text, replacement: each changes what lm-eval would evaluate
    ("data/a.jsonl", "one", "uno"),
    ("data/b.jsonl", "two", "dos"),
    ("utils.py", "return dataset", "return dataset.select([0])"),
    ("base.yaml", "['x', 'y']", "['x', 'z']"),
]


def test_tasks_identity_follows_includes_groups_tags_data_and_functions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file lm-eval reads for a group of tasks, by content; the working directory is where
    lm-eval reads relative data paths from."""
    folder = tmp_path / "tasks"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "a.jsonl").write_text('{"q": "one", "a": 0}\n')
    (folder / "data" / "b.jsonl").write_text('{"q": "two", "a": 0}\n')
    (folder / "utils.py").write_text("def docs(dataset):\n    return dataset\n")
    (folder / "base.yaml").write_text(
        "dataset_path: json\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "process_docs: !function utils.docs\n"
        "doc_to_text: '{{q}}'\n"
        "doc_to_choice: ['x', 'y']\n"
        "doc_to_target: '{{a}}'\n"
    )
    (folder / "task_a.yaml").write_text(
        "include: base.yaml\ntask: task_a\ntag: both\n"
        "dataset_kwargs:\n  data_files:\n    test: data/a.jsonl\n"
    )
    (folder / "task_b.yaml").write_text(
        "include: base.yaml\ntask: task_b\ntag: both\n"
        "dataset_kwargs:\n  data_files:\n    test: data/b*.jsonl\n"
    )
    (folder / "group.yaml").write_text("group: pair\ntask:\n  - task_a\n  - task: task_b\n")
    monkeypatch.chdir(folder)

    def identity(tasks: list[str]) -> str:
        manager = TaskManager(include_path=str(folder), include_defaults=False)
        return sweep.fingerprint(tasks_identity(tasks, manager))

    for tasks in (["pair"], ["both"], ["task_a", "task_b"]):
        before = identity(tasks)
        assert identity(tasks) == before  # content, read again: the same
        for name, old, new in EDITS:
            file = folder / name
            text = file.read_text()
            file.write_text(text.replace(old, new))
            assert identity(tasks) != before, (tasks, name)
            file.write_text(text)
        assert identity(tasks) == before
    with contextlib.chdir(tmp_path):  # elsewhere the relative data files are not there
        assert identity(["task_a"]) != identity(["task_b"])


@pytest.mark.parametrize("name", ["peft", "delta"])
def test_weights_changing_model_args_are_refused_before_anything_runs(
    spec_file: Path,  # noqa: F811
    tmp_path: Path,
    name: str,
) -> None:
    spec = yaml.safe_load(spec_file.read_text())
    spec["eval"]["model_args"][name] = str(tmp_path / "adapter")
    path = tmp_path / "bad.yml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SurgeryConfigError, match=f"sweep.eval.model_args: {name}= changes"):
        sweep.plan(sweep.load_spec(path))
