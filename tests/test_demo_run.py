"""The main job end to end on the tiny scale: stock mergekit-yaml + hf-darts + table + figures."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from demo.configs import (
    ABLATIONS,
    CONTINUATION_TOKENS,
    HEADLINE,
    JOINT_LABEL,
    METHODS,
    ROUTED_LABEL,
    SELECT,
    VARIANTS,
    fixed_variant,
    merge_config,
    variants,
)
from demo.domains import DOMAIN_NAMES
from demo.evaluation import digest
from demo.run import DemoSettings, run_demo
from mergekit_darts.config.schema import DEFAULT_CANDIDATES
from mergekit_darts.correction.darts_correction import PLAIN_KINDS

SELECT_TASKS = [f"{d}_select" for d in DOMAIN_NAMES]  # the joint correction's tasks


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
        JOINT_LABEL,
    ]
    assert [row["kind"] for row in results["rows"]] == [
        "base",
        *["expert"] * len(DOMAIN_NAMES),
        "none",
        *["surgery"] * (len(HEADLINE) + 2),
    ]
    for row in results["rows"]:
        assert set(row["scores"]) == set(DOMAIN_NAMES)
        assert all(0 <= s <= 100 for s in row["scores"].values())
        assert row["n_items"] == {d: 3 for d in DOMAIN_NAMES}
    surgery_rows = results["rows"][-len(HEADLINE) - 2 :]
    assert all(set(row["rho_l1"]) == set(DOMAIN_NAMES) for row in surgery_rows[:-2])
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
    router = surgery_rows[-2]["router_held_out"]
    assert 0 <= router["token_accuracy"] <= 1 and 0 <= router["sequence_accuracy"] <= 1
    _check_joint_row(out, results["rows"], settings.limit)
    shift = results["generic_text_shift"]["task_arithmetic"]
    assert set(shift) == {"prompts", "tokens", "routed", "joint", *DOMAIN_NAMES}
    assert all(shift[k]["kl"] >= 0 for k in ("routed", "joint", *DOMAIN_NAMES))
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
            if seed == 0:  # the yardstick's prompts and level are the first seed's verdict's
                judged = {k: selection["detectable"][k] for k in ("prompts", "level")}
                assert cell["judged"] == judged
    _check_plain_evidence(results, out / "plain.md")
    verdict_md = (out / "verdict.md").read_text()
    assert verdict_md.count("| tiny, seed 0 | task_arithmetic | prompts |") == len(DOMAIN_NAMES)
    assert not (out / "selection.md").exists()  # the held-out study is --full only
    # a second run is served from the caches and gives the same table
    again = run_demo(settings)
    assert again["rows"] == results["rows"]
    assert (out / "table.md").read_text() == table


def _check_joint_row(out, rows: list[dict], limit: int) -> None:
    """The joint row is each seed's merge evaluated under `surgery=joint` (its cached lm-eval
    run, found by that model_args' cache key) and says what each seed's joint verdict kept."""
    none = next(row for row in rows if row["kind"] == "none")
    joint = rows[-1]
    for seed, name in enumerate(("task_arithmetic", "task_arithmetic_seed1")):
        merged = out / "merges" / name
        manifest = json.loads((merged / "surgery/manifest.json").read_text())
        assert manifest["joint"]["tasks"] == SELECT_TASKS
        assert joint["joint_kept"][seed] == manifest["joint"]["module"]
        args = f"pretrained={merged},dtype=float32,surgery=joint"
        key = (out / "merges" / f"{name}.done").read_text()
        cache = out / "evals" / f"{digest(['hf-darts', args, key, limit])}.json"
        assert json.loads(cache.read_text())["scores"] == joint["scores_by_seed"][str(seed)]
        if manifest["joint"]["module"] == "none":  # served as the merge is
            assert joint["scores_by_seed"][str(seed)] == none["scores"]


def _check_plain_evidence(results: dict, path) -> None:
    """The plain kinds' evidence counts the default's verdicts and names the best rows."""
    plain = results["plain"]
    verdicts = [k for cell in results["verdict_cells"] for k in cell["kept"]]
    assert plain["verdicts"] == len(verdicts) == 2 * len(DOMAIN_NAMES)
    kept_plain = sum(k.startswith(("head", "norm")) for k in verdicts)
    assert plain["kept_plain"] == kept_plain
    (merge,) = plain["merges"]
    assert merge["best_plain"]["label"] in {v.label for v in HEADLINE if v.plain}
    table = path.read_text()
    assert f"kept head or norm in {kept_plain} of {len(verdicts)} verdicts" in table


def test_every_default_candidate_has_a_fixed_row_on_every_scale():
    """`select` weighs the block's default candidates, and each one (but none) is a fixed row of
    every scale's table (pos_corr + L1 on the tiny and real scales with `--full` only), on
    prompts, and of the ablations, on completions; the plain ones are headline rows."""
    assert SELECT["candidates"] == list(DEFAULT_CANDIDATES)
    for candidate in DEFAULT_CANDIDATES[1:]:
        fixed = fixed_variant(candidate, 0)
        for scale in ("tiny", "real", "long"):
            assert fixed in variants(True, scale), (candidate, scale)
            assert fixed in variants(False, scale) or fixed.label.startswith("pos_corr + L1")
        assert fixed_variant(candidate, CONTINUATION_TOKENS) in ABLATIONS
    plain = [v.overrides["module"] for v in HEADLINE if v.plain]
    assert plain == list(PLAIN_KINDS)


def test_the_configs_build_without_torch():
    """`python -m demo` imports the configs before it sets the pins, which act only if torch has
    not started yet."""
    code = "import sys, demo.configs; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


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
        assert parsed.joint is not None and parsed.joint.tasks == SELECT_TASKS
        modules = {t.name: t.module for t in parsed.tasks}
        assert [modules[f"{d}_head"] for d in DOMAIN_NAMES] == ["head"] * len(DOMAIN_NAMES)
        assert [modules[f"{d}_norm"] for d in DOMAIN_NAMES] == ["norm"] * len(DOMAIN_NAMES)
        full = merge_config(method, tmp_path / "base", experts, calib, rows=VARIANTS)
        assert len(parse_surgery(full["surgery"]).tasks) == len(VARIANTS) * len(DOMAIN_NAMES)
        assert full["surgery"]["joint"] == {"tasks": SELECT_TASKS}


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


# sha256 of the merge YAMLs `_yamls` writes for the tiny and real scales (the plain rows and the
# joint correction included): a change to them changes those demos' tables, so it is deliberate
TINY_AND_REAL_YAMLS = "8034087cef36619b24696045ef20a27d856b27fdfa73474335c98f8662036b4b"


def _yamls(scale: str, full: bool, root) -> dict[tuple[str, int], str]:
    """Every method's YAML text for surgery seeds 0 and 1, laid out as `make demo` lays it out."""
    family = root / "family"
    experts = {d: family / "experts" / d for d in DOMAIN_NAMES}
    calib = {d: family / "data" / f"{d}_calib.jsonl" for d in DOMAIN_NAMES}
    return {
        (method, seed): yaml.safe_dump(
            merge_config(
                method,
                family / "base",
                experts,
                calib,
                steps=500,
                cache_dir=root / "captures",
                rows=variants(full, scale),
                background=root / "data/bg.jsonl",
                surgery_seed=seed,
            ),
            sort_keys=False,
        )
        for method in METHODS
        for seed in (0, 1)
    }


def test_the_tiny_and_real_scales_keep_their_rows_and_yamls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for scale in ("full", "tiny", "real"):
        assert variants(False, scale) == HEADLINE and variants(True, scale) == VARIANTS
        text = "".join(t for full in (False, True) for t in _yamls(scale, full, tmp_path).values())
        assert hashlib.sha256(text.encode()).hexdigest() == TINY_AND_REAL_YAMLS, scale


def test_the_long_scale_merges_paper_table_10s_grid_and_the_whole_answer_row(tmp_path, monkeypatch):
    """Standard / pos_corr x L1 / EWL1, DARTS calibrated on completions as long as the
    evaluation's generation limit, and the default, as the surgery block parses them."""
    from demo.real_family import SCALES
    from mergekit_darts.config import parse_surgery

    monkeypatch.chdir(tmp_path)
    limit = SCALES["long"].max_gen_toks
    expected = {  # suffix -> (module, loss, continuation tokens, selects)
        "_std": ("standard", "l1", 0, False),
        "_std_ewl1": ("standard", "ewl1", 0, False),
        "_pos_l1": ("pos_corr", "l1", 0, False),
        "": ("pos_corr", "ewl1", 0, False),
        "_cont_answer": ("pos_corr", "ewl1", limit, False),
        "_head": ("head", "ewl1", 0, False),
        "_norm": ("norm", "ewl1", 0, False),
        "_select": (None, None, 0, True),
    }
    assert [v.suffix for v in variants(False, "long")] == list(expected)
    for method, seed in [("task_arithmetic", 0), ("ties", 1)]:
        config = yaml.safe_load(_yamls("long", False, tmp_path)[method, seed])
        tasks = {t.name: t for t in parse_surgery(config["surgery"]).tasks}
        assert len(tasks) == len(expected) * len(DOMAIN_NAMES)
        for domain in DOMAIN_NAMES:
            for suffix, (module, loss, tokens, selects) in expected.items():
                task = tasks[domain + suffix]
                assert (task.module, task.loss) == (module, loss), domain + suffix
                assert task.calibration.continuation_tokens == tokens, domain + suffix
                assert (task.select is not None) == selects, domain + suffix
                # only DARTS answers `surgery=auto`; the routed row routes over the DARTS tasks
                assert task.eval_tasks == ([f"demo_{domain}"] if suffix == "" else [])
        assert config["surgery"]["route"]["tasks"] == list(DOMAIN_NAMES)
        assert config["surgery"]["joint"] == {"tasks": SELECT_TASKS}
    full = variants(True, "long")
    assert full[: len(expected)] == variants(False, "long")
    assert len({v.suffix for v in full}) == len({v.label for v in full}) == len(full)
