"""`surgery.target_vocab: prefix`: targets that append tokens (WizardMath's 32001 vs 32000)."""

from __future__ import annotations

import inspect
import json

import mergekit.merge
import pytest
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from test_config import merge_config, refuse
from tiny import build_tokenizer, save_model

from mergekit_darts.hook import merge_with_surgery


@pytest.fixture(scope="module")
def extended(tiny_family, tmp_path_factory):
    """The math expert with one token appended to its tokenizer and embedding rows."""
    root = tmp_path_factory.mktemp("extended")
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["[PAD]"])
    save_model(root / "math_plus", tokenizer, seed=5)  # vocab_size = len(tokenizer): one more
    swapped = root / "math_swapped"
    save_model(swapped, tokenizer, seed=6)
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    return root


def _with_target(config, target, **block):
    config["surgery"]["tasks"] = config["surgery"]["tasks"][:1]
    config["surgery"]["tasks"][0]["target"] = str(target)
    config["surgery"].update(block)
    return config


def test_appended_tokens_are_refused_by_default(tiny_family, calibration_data, extended, tmp_path):
    config = _with_target(merge_config(tiny_family, calibration_data), extended / "math_plus")
    message = refuse(config, tmp_path / "out")
    assert "vocab_size" in message and "target_vocab: prefix" in message


def test_prefix_refuses_kl_and_moved_ids(tiny_family, calibration_data, extended, tmp_path):
    config = _with_target(
        merge_config(tiny_family, calibration_data), extended / "math_plus", target_vocab="prefix"
    )
    config["surgery"]["loss"] = "kl"
    assert "vocab_size" in refuse(config, tmp_path / "a")
    config = _with_target(
        merge_config(tiny_family, calibration_data),
        extended / "math_swapped",
        target_vocab="prefix",
    )
    assert "4 token/id pairs differ" in refuse(config, tmp_path / "b")


def test_prefix_target_calibrates(tiny_family, calibration_data, extended, tmp_path):
    config = _with_target(
        merge_config(tiny_family, calibration_data), extended / "math_plus", target_vocab="prefix"
    )
    out = tmp_path / "out"
    merge_with_surgery(
        inspect.unwrap(mergekit.merge.run_merge),
        MergeConfiguration.model_validate(config),
        str(out),
        MergeOptions(quiet=True),
        yaml.safe_dump(config, sort_keys=False),
    )
    manifest = json.loads((out / "surgery" / "manifest.json").read_text())
    assert manifest["tasks"]["math"]["metrics"]["rho_l1"] > 0
