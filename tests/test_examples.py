"""Every example YAML in the repo is a valid mergekit config with a valid surgery block."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml
from mergekit.config import MergeConfiguration

from mergekit_darts.config import parse_surgery

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MERGE_YAMLS = sorted(
    p for p in EXAMPLES.rglob("*.yml") if "merge_method" in p.read_text() and "tasks/" not in str(p)
)


def test_examples_exist():
    names = {p.relative_to(EXAMPLES).as_posix() for p in MERGE_YAMLS}
    for method in ("task_arithmetic", "ties", "dare_ties", "linear"):
        assert f"llama2-7b/{method}.yml" in names


@pytest.mark.parametrize("path", MERGE_YAMLS, ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_example_is_valid(path):
    config = yaml.safe_load(path.read_text())
    surgery = parse_surgery(config.pop("surgery"))
    MergeConfiguration.model_validate(config)
    assert surgery.tasks


def test_heldout_tasks_drop_the_calibration_items():
    from datasets import Dataset
    from lm_eval.tasks._yaml_loader import load_yaml

    tasks = EXAMPLES / "llama2-7b" / "tasks"
    spec = importlib.util.spec_from_file_location("heldout_utils", tasks / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    kept = utils.drop_calibration(Dataset.from_dict({"i": list(range(164))}))
    assert kept["i"] == list(range(50, 164))  # HumanEval: 114 evaluated, as in appendix A
    for name in ("gsm8k_cot_zeroshot_heldout", "humaneval_heldout"):
        config = load_yaml(tasks / f"{name}.yaml")  # what lm-eval itself runs
        assert config["task"] == name
        assert callable(config["process_docs"])


@pytest.mark.parametrize("name", ["sweep.yml", "grid.yml"])
def test_sweep_examples_are_valid(name, monkeypatch, tmp_path):
    from mergekit_darts.analysis import sweep

    monkeypatch.chdir(EXAMPLES.parent)  # their paths resolve from the repository root
    spec = sweep.load_spec(EXAMPLES / name)
    assert len(sweep.plan(spec)) > 1 and sweep.cache_dir(spec) == "runs/demo/captures"
    if spec.merges:
        merges = sweep.locate_merges(spec, tmp_path)
        assert [m.name for m in merges] == ["linear", "task_arithmetic", "ties"]
