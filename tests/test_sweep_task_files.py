"""A sweep re-run after an eval task's files changed scores its cells again.

The cell fingerprint holds what lm-eval reads for the eval tasks by content (each config with the
YAMLs it includes, the data files, folders and ``!function`` modules it names), not only their
names: an edited data file or task YAML reruns the cells instead of keeping the old scores. An
``hf-darts`` argument that changes the merged weights (``peft=``, ``delta=``) is refused up front.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import yaml
from lm_eval.tasks import TaskManager
from test_sweep import EVAL_TASKS, Counting, spec_file  # noqa: F401  (spec_file: a fixture)

from mergekit_darts.analysis import sweep
from mergekit_darts.analysis.sweep import cell as sweep_cell
from mergekit_darts.analysis.sweep.cell import tasks_identity
from mergekit_darts.errors import SurgeryConfigError


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
    evaluate = Counting(sweep_cell.evaluate)
    monkeypatch.setattr(sweep_cell, "evaluate", evaluate)

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
