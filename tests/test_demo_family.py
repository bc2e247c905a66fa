"""The demo family builds, caches, is deterministic, and its artifacts load offline."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo import FamilyPaths, build_family
from demo import family as family_module
from demo.domains import DOMAIN_NAMES
from demo.family_io import family_paths
from demo.pinning import pinned_env

pytestmark = pytest.mark.slow  # every test here builds (trains) the tiny demo family


@pytest.fixture(scope="module")
def tiny_family(tmp_path_factory: pytest.TempPathFactory) -> FamilyPaths:
    return build_family(tmp_path_factory.mktemp("family"), seed=0, scale="tiny", progress=False)


def _records(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_all_artifacts_exist(tiny_family: FamilyPaths) -> None:
    assert set(tiny_family.experts) == set(DOMAIN_NAMES)
    for folder in [tiny_family.base, *tiny_family.experts.values()]:
        for name in ("model.safetensors", "config.json", "tokenizer.json"):
            assert (folder / name).is_file(), folder / name
        assert not list(folder.glob("*.bin")), "weights must be safetensors only"
    for domain in DOMAIN_NAMES:
        assert tiny_family.calib_file(domain).is_file()
        assert tiny_family.eval_file(domain).is_file()
    assert (tiny_family.root / "family.json").is_file()


def test_models_and_tokenizer_load(tiny_family: FamilyPaths) -> None:
    for folder in [tiny_family.base, *tiny_family.experts.values()]:
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.config.hidden_size == 128
        assert model.config.max_position_embeddings >= 512
        assert not model.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(tiny_family.base)
    for domain in DOMAIN_NAMES:
        for record in _records(tiny_family.eval_file(domain)):
            text = f"{record['prompt']} {record['answer']}"
            ids = tokenizer(text)["input_ids"]
            assert tokenizer.unk_token_id not in ids
            assert tokenizer.decode(ids) == text


def test_splits_are_disjoint(tiny_family: FamilyPaths) -> None:
    for domain in DOMAIN_NAMES:
        calib = [r["prompt"] for r in _records(tiny_family.calib_file(domain))]
        evals = _records(tiny_family.eval_file(domain))
        assert len(calib) == len(set(calib)) == 50
        assert (
            len(evals) == len({r["prompt"] for r in evals}) == family_module.SCALES["tiny"].n_eval
        )
        assert all(r["answer"] for r in evals)
        assert not set(calib) & {r["prompt"] for r in evals}


def test_task_yamls_point_at_eval_data(tiny_family: FamilyPaths) -> None:
    for domain in DOMAIN_NAMES:
        task = yaml.safe_load((tiny_family.tasks / f"demo_{domain}.yaml").read_text())
        assert task["task"] == f"demo_{domain}"
        assert task["output_type"] == "generate_until"
        data_file = Path(task["dataset_kwargs"]["data_files"]["test"])
        assert data_file.is_absolute()
        assert data_file == tiny_family.eval_file(domain)


def test_second_build_is_a_cache_hit(
    tiny_family: FamilyPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("cached family was retrained")

    monkeypatch.setattr(family_module, "_train_family", no_training)
    again = build_family(tiny_family.root, seed=0, scale="tiny", progress=False)
    assert again == tiny_family


def test_a_family_built_under_other_pins_is_rebuilt(
    tiny_family: FamilyPaths, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = shutil.copytree(tiny_family.root, tmp_path / "family")  # the fixture stays intact

    class Retrained(Exception):
        pass

    def retrain(*args: object, **kwargs: object) -> None:
        raise Retrained

    monkeypatch.setattr(family_module, "_train_family", retrain)
    build_family(copy, seed=0, scale="tiny", progress=False)  # same pins: a cache hit
    monkeypatch.setattr(family_module, "PINS", {**family_module.PINS, "MKL_CBWR": "AVX2"})
    with pytest.raises(Retrained):
        build_family(copy, seed=0, scale="tiny", progress=False)


def test_build_is_deterministic(tiny_family: FamilyPaths, tmp_path: Path) -> None:
    other = build_family(tmp_path, seed=0, scale="tiny", progress=False)
    for domain in DOMAIN_NAMES:
        weights = tiny_family.experts[domain] / "model.safetensors"
        assert (other.experts[domain] / "model.safetensors").read_bytes() == weights.read_bytes()
        assert other.eval_file(domain).read_text() == tiny_family.eval_file(domain).read_text()


# the family as `python -m demo` builds it (the experts in parallel, one process each), and the
# sequential build it must equal: the base, then each expert in turn in the same process
PARALLEL = "import sys; from demo import build_family; build_family(sys.argv[1], 0, 'tiny', False)"
SEQUENTIAL = """import sys
from demo import family
def one_by_one(paths, train, held_out, progress):
    return {domain: train(domain, held_out[domain], None) for domain in paths.experts}
family.train_experts = one_by_one
family.build_family(sys.argv[1], 0, 'tiny', False)
"""


def _weights_sha256(script: str, root: Path) -> dict[str, str]:
    done = subprocess.run(
        [sys.executable, "-c", script, str(root)],
        env=pinned_env(os.environ),  # as `python -m demo` runs it
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    family = family_paths(root)
    folders = {"base": family.base, **family.experts}
    return {
        name: hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
        for name, folder in folders.items()
    }


def test_experts_trained_in_parallel_are_the_sequential_build_bit_for_bit(tmp_path: Path) -> None:
    parallel = _weights_sha256(PARALLEL, tmp_path / "parallel")
    sequential = _weights_sha256(SEQUENTIAL, tmp_path / "sequential")
    assert parallel == sequential
    assert len(set(parallel.values())) == len(parallel)  # four different models, not one copied
