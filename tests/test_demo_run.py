"""The main job end to end on the tiny scale: stock mergekit-yaml + hf-darts + table + figures."""

from __future__ import annotations

import json

import pytest
import yaml

from demo.configs import (
    HEADLINE,
    METHODS,
    ROUTED_LABEL,
    VARIANTS,
    fixed_variant,
    merge_config,
)
from demo.domains import DOMAIN_NAMES
from demo.run import DemoSettings, run_demo


@pytest.mark.slow
def test_demo_pipeline_produces_every_artifact_and_row(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the YAMLs hold cwd-relative paths, like mergekit's `model:`
    settings = DemoSettings(
        out=tmp_path / "demo",
        scale="tiny",
        methods=("task_arithmetic",),
        steps=5,
        limit=3,
        surgery_seeds=2,
    )
    results = run_demo(settings)
    out = settings.out
    labels = [row["label"] for row in results["rows"]]
    assert labels == [
        "Base",
        *(f"Expert: {d}" for d in DOMAIN_NAMES),
        "None (merged)",
        *(v.label for v in HEADLINE),
        ROUTED_LABEL,
    ]
    assert [row["kind"] for row in results["rows"]] == [
        "base",
        *["expert"] * len(DOMAIN_NAMES),
        "none",
        *["surgery"] * (len(HEADLINE) + 1),
    ]
    for row in results["rows"]:
        assert set(row["scores"]) == set(DOMAIN_NAMES)
        assert all(0 <= s <= 100 for s in row["scores"].values())
        assert row["n_items"] == {d: 3 for d in DOMAIN_NAMES}
    surgery_rows = results["rows"][-len(HEADLINE) - 1 :]
    assert all(set(row["rho_l1"]) == set(DOMAIN_NAMES) for row in surgery_rows[:-1])
    assert all(len(row["delta_vs_none"]["ci95"]) == 2 for row in surgery_rows)
    for row in surgery_rows:  # every surgery row ran once per surgery seed, on the same merge
        assert row["surgery_seeds"] == [0, 1] and set(row["scores_by_seed"]) == {"0", "1"}
        assert row["scores_by_seed"]["0"] == row["scores"]
        over = row["delta_vs_none_over_seeds"]
        assert set(over["by_seed"]) == {"0", "1"} and len(over["ci95"]) == 2
        assert over["direction"] in {"better", "worse", "no difference"}
        assert over["seed_range"] == [min(over["by_seed"].values()), max(over["by_seed"].values())]
    seed1 = yaml.safe_load((out / "configs/task_arithmetic_seed1.yml").read_text())
    assert seed1["surgery"]["seed"] == 1
    assert (
        "seed" not in yaml.safe_load((out / "configs/task_arithmetic.yml").read_text())["surgery"]
    )
    other = out / "merges/task_arithmetic_seed1/surgery"
    assert (other / "code.safetensors").read_bytes() != (
        out / "merges/task_arithmetic/surgery/code.safetensors"
    ).read_bytes()  # the seed reached the training
    router = surgery_rows[-1]["router_held_out"]
    assert 0 <= router["token_accuracy"] <= 1 and 0 <= router["sequence_accuracy"] <= 1
    shift = results["generic_text_shift"]["task_arithmetic"]
    assert set(shift) == {"prompts", "tokens", "routed", *DOMAIN_NAMES}
    assert all(shift[k]["kl"] >= 0 for k in ("routed", *DOMAIN_NAMES))
    pins = results["settings"]["pins"]
    assert pins["torch_threads"] == 1 and pins["env"]["ATEN_CPU_CAPABILITY"] == "avx2"
    assert results["settings"]["surgery_seeds"] == 2
    assert results["cpu_seconds"] > 0 and "mkl_branch" in results["settings"]["pins"]
    assert {"torch", "transformers", "lm_eval", "mergekit"} <= set(results["settings"]["versions"])
    table = (out / "table.md").read_text()
    assert all(label in table for label in labels)
    assert json.loads((out / "results.json").read_text())["rows"] == results["rows"]
    manifest = json.loads((out / "merges/task_arithmetic/surgery/manifest.json").read_text())
    assert len(manifest["tasks"]) == len(HEADLINE) * len(DOMAIN_NAMES)
    for domain in DOMAIN_NAMES:
        for kind in ("delta_heatmap", "delta_by_position"):
            png = out / "figures" / f"task_arithmetic_{domain}_{kind}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a select task keeps one candidate, refit on every prompt: the fixed row's module, byte for byte
    surgery = out / "merges/task_arithmetic/surgery"
    for variant in (v for v in HEADLINE if v.selects):
        for domain in DOMAIN_NAMES:
            selection = manifest["tasks"][domain + variant.suffix]["selection"]
            chosen = selection["candidates"][selection["chosen"]]
            if chosen["module"] == "none":  # the merge as it is: a file without tensors
                assert manifest["tasks"][domain + variant.suffix]["module"] == "none"
                continue
            fixed = fixed_variant(chosen, variant.continuation_tokens)
            if fixed not in HEADLINE:  # pos_corr + L1 is a row only with --full
                continue
            assert (surgery / f"{domain}{variant.suffix}.safetensors").read_bytes() == (
                surgery / f"{domain}{fixed.suffix}.safetensors"
            ).read_bytes()
    # the verdict's evidence: one cell per domain, what the default kept on each surgery seed
    cells = results["verdict_cells"]
    assert [(c["merge"], c["domain"]) for c in cells] == [
        ("task_arithmetic", d) for d in DOMAIN_NAMES
    ]
    for cell in cells:
        for seed, kept in enumerate(cell["kept"]):
            name = "task_arithmetic" if seed == 0 else f"task_arithmetic_seed{seed}"
            entry = json.loads((out / f"merges/{name}/surgery/manifest.json").read_text())
            selection = entry["tasks"][cell["domain"] + "_select"]["selection"]
            chosen = selection["candidates"][selection["chosen"]]
            assert (kept == "none") == (chosen["module"] == "none")
    verdict_md = (out / "verdict.md").read_text()
    assert verdict_md.count("| tiny | task_arithmetic | prompts |") == len(DOMAIN_NAMES)
    assert not (out / "selection.md").exists()  # the held-out study is --full only
    # a second run is served from the caches and gives the same table
    again = run_demo(settings)
    assert again["rows"] == results["rows"]
    assert (out / "table.md").read_text() == table


def test_every_method_yaml_is_a_valid_merge_config(tmp_path):
    from mergekit.config import MergeConfiguration

    from mergekit_darts.config import parse_surgery

    experts = {d: tmp_path / d for d in DOMAIN_NAMES}
    calib = {d: tmp_path / f"{d}.jsonl" for d in DOMAIN_NAMES}
    for method in METHODS:
        config = merge_config(method, tmp_path / "base", experts, calib)
        surgery = config.pop("surgery")
        MergeConfiguration.model_validate(yaml.safe_load(yaml.safe_dump(config)))
        parsed = parse_surgery(surgery)
        assert len(parsed.tasks) == len(HEADLINE) * len(DOMAIN_NAMES)
        full = merge_config(method, tmp_path / "base", experts, calib, rows=VARIANTS)
        assert len(parse_surgery(full["surgery"]).tasks) == len(VARIANTS) * len(DOMAIN_NAMES)


def test_examples_demo_match_what_the_driver_writes(monkeypatch):
    from pathlib import Path

    from demo.configs import merge_config
    from demo.family_io import family_paths

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)  # `make demo` runs from the repository root
    family = family_paths((repo / "runs/demo/family").resolve())
    calib = {d: family.calib_file(d) for d in DOMAIN_NAMES}
    background = repo / "runs/demo/data/generic_background.jsonl"
    for method in METHODS:
        expected = merge_config(
            method,
            family.base,
            family.experts,
            calib,
            cache_dir=repo / "runs/demo/captures",
            background=background,
        )
        assert yaml.safe_load((repo / f"examples/demo/{method}.yml").read_text()) == expected
