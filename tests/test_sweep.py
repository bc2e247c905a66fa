"""A 2 x 2 x 2-seed sweep on the tiny models completes, and resumes after a kill without redoing cells."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
import yaml
from click.testing import CliRunner

from mergekit_darts import sweep
from mergekit_darts.config import SurgeryConfigError

EVAL_TASKS = ["sweep_a", "sweep_b"]
ITEMS = [
    ("question : two plus three is", ["five", "six", "seven"]),
    ("repeat the word cat", ["cat", "dog", "red"]),
    ("reverse red blue", ["blue red", "red blue", "green"]),
    ("def add ( x , y ) : return", ["x plus y", "x minus y", "x times y"]),
    ("question : nine minus four is", ["five", "four", "nine"]),
]


def _write_tasks(folder):
    """Two offline multiple-choice lm-eval tasks over one local jsonl (absolute path)."""
    folder.mkdir()
    data = folder / "items.jsonl"
    data.write_text(
        "".join(json.dumps({"q": q, "choices": c, "answer": 0}) + "\n" for q, c in ITEMS)
    )
    for name in EVAL_TASKS:
        config = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            "output_type": "multiple_choice",
            "doc_to_text": "{{q}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0},
        }
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config))


@pytest.fixture(scope="module")
def spec_file(tiny_family, tiny_merged, tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    shutil.copytree(tiny_merged, root / "merged")
    calib = root / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": p}) + "\n" for p in tiny_family.prompts))
    _write_tasks(root / "tasks")
    block = {
        "rank": 4,
        "max_positions": 16,
        "steps": 3,
        "lr": 1e-2,
        "batch_size": 4,
        "cache_dtype": "float32",
        "tasks": [
            {
                "name": "math",
                "target": str(tiny_family.math),
                "eval_tasks": EVAL_TASKS,
                "calibration": {"path": str(calib), "num_samples": 6, "max_length": 16},
            }
        ],
    }
    spec = {
        "merged": str(root / "merged"),
        "surgery": block,
        "output": str(root / "out"),
        "grid": {"module": ["standard", "pos_corr"], "loss": ["l1", "ewl1"], "seed": [0, 1]},
        "eval": {
            "tasks": EVAL_TASKS,
            "include_path": str(root / "tasks"),
            "include_defaults": False,
            "limit": 4,
            "batch_size": 4,
            "device": "cpu",
            "model_args": {"dtype": "float32"},
        },
        "compare": {"a": "module=pos_corr,loss=ewl1", "b": "module=standard,loss=l1"},
    }
    path = root / "sweep.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


class Counting:
    """Wraps a sweep step, counts calls, and can fail on the n-th call (a simulated kill)."""

    def __init__(self, fn, fail_on: int | None = None):
        self.fn, self.fail_on, self.calls = fn, fail_on, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_on:
            raise KeyboardInterrupt("simulated kill")
        return self.fn(*args, **kwargs)


def test_sweep_completes_and_resumes_after_a_kill(spec_file, monkeypatch):
    spec = sweep.load_spec(spec_file)
    output = sweep.output_dir(spec, spec_file)
    evaluate = Counting(sweep.evaluate, fail_on=4)  # baseline + 2 cells finish, the 3rd dies
    monkeypatch.setattr(sweep, "evaluate", evaluate)
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
    calibrate = Counting(sweep.calibrate)
    monkeypatch.setattr(sweep, "evaluate", evaluate)
    monkeypatch.setattr(sweep, "calibrate", calibrate)
    run = CliRunner().invoke(sweep.sweep_command, [str(spec_file)])
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
        ({"merged": None}, "sweep.merged: input should be a valid string"),
    ],
)
def test_spec_errors_name_the_key(tmp_path, patch, message):
    spec = {"merged": "m", "surgery": "s.yml", "grid": {"seed": [0]}, "eval": {"tasks": ["a"]}}
    path = tmp_path / "sweep.yml"
    path.write_text(yaml.safe_dump({**spec, **patch}))
    with pytest.raises(SurgeryConfigError) as err:
        sweep.load_spec(path)
    assert str(err.value.message).startswith(message) and "\n" not in err.value.message


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
