"""The joint correction: one plain correction fitted on every task's prompts at once, judged by
the verdict on every task, served with no task id (``surgery=joint``, ``export --joint``)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from tiny import random_module, surgery_task, write_surgery
from transformers import AutoModelForCausalLM

from mergekit_darts import apply_surgery, run_surgery
from mergekit_darts.calibrate.verdict import decide_joint, signed_rank_test
from mergekit_darts.errors import DartsError

ALPHA = 0.05
N, T, H = 5, 7, 6


def two_task_block(family, data: Path, **settings) -> dict:
    """Tasks math and code of the tiny family, 12 prompts each, under ``settings``."""
    quick = {"calibration": {"max_length": 24}}
    return {
        "steps": 15,
        "batch_size": 4,
        "max_positions": 64,
        "cache_dtype": "float32",
        **settings,
        "tasks": [
            surgery_task("math", family.math, data / "math.jsonl", **quick),
            surgery_task("code", family.code, data / "code.jsonl", **quick),
        ],
    }


def candidate(scores: dict[str, list[float]], module: str = "head") -> dict:
    return {"module": module, "loss": "ewl1", "verdict": scores}


def test_joint_is_kept_when_it_beats_none_pooled_and_harms_no_task() -> None:
    none = {"a": [0.0] * 8, "b": [0.0] * 8}
    better = candidate({"a": [1.0] * 8, "b": [0.5] * 8})
    decision = decide_joint([better], ["head + ewl1"], none, "completion_prefix", ALPHA)
    assert decision.chosen == 0 and decision.line.startswith("kept joint head + ewl1")
    pooled = signed_rank_test([1.0] * 8 + [0.5] * 8, [0.0] * 16)
    assert better["test"]["p"] == pooled["p"] and better["test"]["p"] <= ALPHA
    assert better["tasks"]["b"]["mean"] == 0.5 and better["tasks"]["b"]["better"] == 8


def test_joint_is_refused_where_it_is_worse_than_none_on_one_task() -> None:
    none = {"a": [0.0] * 10, "b": [0.0] * 8}
    # a large gain on a, a loss on every prompt of b: pooled it passes, but b is harmed
    mixed = candidate({"a": [5.0] * 10, "b": [-1.0] * 8})
    decision = decide_joint([mixed], ["head + ewl1"], none, "completion_prefix", ALPHA)
    assert mixed["test"]["p"] <= ALPHA
    assert decision.chosen == -1 and "worse than none on b" in decision.line
    assert mixed["tasks"]["b"]["p_worse"] == pytest.approx(2.0**-8)


def test_joint_type_one_rate_under_the_null_is_at_most_alpha() -> None:
    """No candidate better than none (each prompt's difference symmetric about 0): kept at most
    alpha of the time, with two candidates tried."""
    rng = random.Random(0)
    kept, trials = 0, 2000
    for _ in range(trials):
        none = {t: [float(rng.randint(0, 6)) for _ in range(12)] for t in ("a", "b")}
        entries = [
            candidate(
                {t: [v + rng.choice((-1, 1)) * rng.randint(0, 3) for v in none[t]] for t in none}, m
            )
            for m in ("head", "norm")
        ]
        decision = decide_joint(entries, ["head", "norm"], none, "completion_prefix", ALPHA)
        kept += decision.chosen >= 0
    assert kept / trials <= ALPHA


@pytest.mark.slow
def test_a_two_task_plain_block_fits_judges_and_serves_a_joint_correction(
    tiny_family, calibration_data: Path, tiny_merged: Path, tmp_path: Path
) -> None:
    from mergekit_darts.hosts.deploy.export import export

    merged = Path(shutil.copytree(tiny_merged, tmp_path / "merged"))
    run_surgery(merged, two_task_block(tiny_family, calibration_data, plain=True), progress=False)
    manifest = json.loads((merged / "surgery" / "manifest.json").read_text())
    joint = manifest["joint"]
    assert joint["tasks"] == ["math", "code"] and joint["module"] in ("none", "head", "norm")
    selection = joint["selection"]
    assert [c["module"] for c in selection["candidates"]] == ["head", "norm"]
    for entry in selection["candidates"]:
        assert set(entry["tasks"]) == {"math", "code"}
        # every judged prompt of each task scored once, cross-fitted
        assert len(entry["verdict"]["math"]) == len(
            manifest["tasks"]["math"]["calibration"]["prompt_sha256"]
        )
    assert (merged / "surgery" / "joint.safetensors").is_file()
    card = (merged / "README.md").read_text()
    assert "### Joint correction" in card and selection["verdict"] in card
    for task in ("math", "code"):
        assert f"| head + ewl1 | `{task}` |" in card
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    ids = torch.randint(3, 60, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(ids).logits
    with apply_surgery(model, merged / "surgery", "joint"), torch.no_grad():
        corrected = model(ids).logits
    export(merged, tmp_path / "joint", joint=True)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "joint", dtype=torch.float32).eval()
    with torch.no_grad():
        served = exported(ids).logits
    assert (served - corrected).abs().max() <= 1e-4
    if joint["module"] != "none":
        assert (corrected - plain).abs().max() > 1e-4
    config = json.loads((tmp_path / "joint" / "config.json").read_text())
    assert "auto_map" not in config


@pytest.mark.slow
def test_surgery_joint_without_a_joint_correction_is_one_line(
    tiny_family, calibration_data: Path, tiny_merged: Path, tmp_path: Path
) -> None:
    from tiny import quick_block

    from mergekit_darts.hosts.deploy.export import export

    merged = Path(shutil.copytree(tiny_merged, tmp_path / "merged"))
    run_surgery(merged, quick_block(tiny_family, calibration_data, plain=True), progress=False)
    assert "joint" not in json.loads((merged / "surgery" / "manifest.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    with pytest.raises(DartsError) as err:
        apply_surgery(model, merged / "surgery", "joint")
    assert "no joint correction" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DartsError) as err:
        export(merged, tmp_path / "out", joint=True)
    assert "no joint correction" in str(err.value) and not (tmp_path / "out").exists()


def task_run(task, seed: int):
    """A run of ``task`` with synthetic captures: the target a mixed copy of the merge."""
    from mergekit_darts.calibrate.capture import Captured
    from mergekit_darts.calibrate.choose import TaskRun
    from mergekit_darts.calibrate.data import Prompts

    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(T) < torch.randint(2, T + 1, (N, 1), generator=g)
    h = torch.randn(N, T, H, generator=g) * mask.unsqueeze(-1)
    mix = torch.eye(H) + 0.4 * torch.randn(H, H, generator=g)
    entropy = torch.rand(N, T, generator=g) + 0.1
    run = TaskRun(task, Prompts([], [], "x"), [])
    run.merged = Captured(hidden=h, mask=mask)
    run.target = Captured(hidden=h @ mix.T, mask=mask, entropy=entropy)
    return run


def test_the_joint_fit_solves_every_tasks_statistics_summed(tmp_path: Path) -> None:
    """One ridge regression towards the identity over both tasks' tokens, each weighted by its
    own task's normalised entropy (float64 least squares written here)."""
    from mergekit_darts.calibrate.joint import _fit
    from mergekit_darts.calibrate.plain_fit import RIDGE
    from mergekit_darts.config import parse_surgery, resolve_tasks

    (tmp_path / "p.txt").write_text("a\n")
    task = lambda name: surgery_task(name, tmp_path, tmp_path / "p.txt", field=None)  # noqa: E731
    block = {"plain": True, "tasks": [task("math"), task("code")]}
    tasks = [t.candidates()[1] for t in resolve_tasks(parse_surgery(block))]  # head + ewl1
    runs = [task_run(t, seed) for t, seed in zip(tasks, (0, 1), strict=True)]
    module = _fit(tasks, runs, [None, None])
    xs, ys, ws = [], [], []
    for run in runs:
        mask = run.merged.mask
        e = run.target.entropy[mask].double()
        xs.append(run.merged.hidden[mask].double())
        ys.append(run.target.hidden[mask].double())
        ws.append(e / e.mean())
    x, y, root = torch.cat(xs), torch.cat(ys), torch.cat(ws).sqrt().unsqueeze(-1)
    lam = RIDGE * float(((root * x) ** 2).sum(0).mean())
    eye = torch.eye(H, dtype=torch.float64)
    design, wanted = torch.cat([root * x, lam**0.5 * eye]), torch.cat([root * y, lam**0.5 * eye])
    a = torch.linalg.lstsq(design, wanted).solution.T
    assert (module.weight.double() - (eye - a)).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["head", "norm"])
def test_a_joint_export_is_the_joint_correction_in_stock_transformers(
    tmp_path: Path, kind: str
) -> None:
    from transformers import AutoConfig

    from mergekit_darts.hosts.deploy.export import export

    config = AutoConfig.for_model(
        "llama",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "merged")
    merged = tmp_path / "merged"
    tasks = {n: random_module("standard", 32, 4, 16, seed=i) for i, n in enumerate(["a", "b"])}
    joint = random_module(kind, 32, 4, 16, seed=7, scale=0.3)
    write_surgery(merged / "surgery", tasks, joint=joint)
    export(merged, tmp_path / "joint", joint=True, link="copy")
    exported, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "joint", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    written = json.loads((tmp_path / "joint" / "config.json").read_text())
    assert "auto_map" not in written and written["tie_word_embeddings"] is (kind != "head")
    reference = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = reference(ids).logits
        with apply_surgery(reference, merged / "surgery", "joint"):
            corrected = reference(ids).logits
        served = exported.eval()(ids).logits
    assert (served - corrected).abs().max() <= 1e-4
    assert (corrected - plain).abs().max() > 1e-3
    card = (tmp_path / "joint" / "README.md").read_text()
    assert "joint plain correction of tasks `a`, `b`" in card


def test_hf_darts_surgery_joint_serves_what_the_cli_export_serves(
    tiny_family, tiny_merged: Path, tmp_path: Path
) -> None:
    """``hf-darts`` ``surgery=joint`` on lm-eval's right-padded call equals the plain folder the
    ``export --joint`` command writes (no plugin, no trust_remote_code)."""
    from click.testing import CliRunner

    from lm_eval_darts.model import DartsHFLM
    from mergekit_darts.cli import main

    merged = Path(shutil.copytree(tiny_merged, tmp_path / "merged"))
    tasks = {n: random_module("pos_corr", 64, 4, 16, seed=i) for i, n in enumerate(["a", "b"])}
    write_surgery(merged / "surgery", tasks, joint=random_module("head", 64, 4, 16, seed=5))
    run = CliRunner().invoke(main, ["export", str(merged), "--joint", str(tmp_path / "dest")])
    assert run.exit_code == 0, run.output
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "dest", dtype=torch.float32).eval()
    lm = DartsHFLM(pretrained=str(merged), surgery="joint", device="cpu", dtype="float32")
    seqs = [lm.tok_encode(p) for p in tiny_family.prompts[:4]]
    width = max(map(len, seqs))
    right = torch.tensor([ids + [lm.tokenizer.pad_token_id] * (width - len(ids)) for ids in seqs])
    logits = lm._model_call(right)
    with torch.no_grad():
        for row, ids in zip(logits, seqs, strict=True):
            want = exported(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(row[: len(ids)], want, rtol=0, atol=1e-4)


def test_hf_darts_surgery_joint_without_one_is_one_line(tiny_merged: Path, tmp_path: Path) -> None:
    from lm_eval_darts.model import DartsHFLM

    merged = Path(shutil.copytree(tiny_merged, tmp_path / "merged"))
    write_surgery(merged / "surgery", {"a": random_module("head", 64, 4, 16, seed=1)})
    with pytest.raises(DartsError) as err:
        DartsHFLM(pretrained=str(merged), surgery="joint", device="cpu")
    assert "no joint correction" in str(err.value) and "\n" not in str(err.value)


def block_of(tmp_path: Path, names: list[str], **settings) -> dict:
    (tmp_path / "p.txt").write_text("a\n")
    tasks = [surgery_task(n, tmp_path, tmp_path / "p.txt", field=None) for n in names]
    return {**settings, "tasks": tasks}


def plan_of(block: dict):
    from mergekit_darts.config import parse_surgery, plan_joint, resolve_tasks

    config = parse_surgery(block)
    return plan_joint(config, resolve_tasks(config))


def test_joint_is_planned_over_every_task_or_the_ones_named(tmp_path: Path) -> None:
    plan = plan_of(block_of(tmp_path, ["a", "b", "c"], plain=True))
    assert plan.tasks == ("a", "b", "c")
    assert plan.candidates == (("head", "ewl1"), ("norm", "ewl1"))
    named = plan_of(block_of(tmp_path, ["a", "b", "c"], plain=True, joint={"tasks": ["c", "a"]}))
    assert named.tasks == ("c", "a")
    assert plan_of(block_of(tmp_path, ["a", "b"], plain=True, joint="off")) is None
    assert plan_of(block_of(tmp_path, ["a"], plain=True)) is None
    # unwritten and impossible (a fixed module, no verdict): silently none
    assert plan_of(block_of(tmp_path, ["a", "b"], module="head")) is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"plain": True, "joint": {"tasks": ["a", "x"]}},
            "surgery.joint.tasks[1]: no task named 'x' in the block (it has a, b)",
        ),
        (
            {"plain": True, "joint": {"tasks": ["a", "a"]}},
            "surgery.joint.tasks[1]: task 'a' is listed twice",
        ),
        ({"plain": True, "joint": {"tasks": ["a"]}}, "surgery.joint: a joint correction serves"),
        (
            {"joint": {"tasks": ["a", "b"]}, "module": "head"},
            "surgery.joint: cannot fit a joint correction: task 'a' is not judged by the",
        ),
        (
            {"joint": {}, "select": {"candidates": [{"module": "pos_corr"}]}},
            "surgery.joint: cannot fit a joint correction: no plain candidate",
        ),
        ({"joint": "on", "plain": True}, "surgery.joint: expected a mapping of joint settings"),
    ],
)
def test_a_joint_that_cannot_be_fitted_is_one_line(tmp_path: Path, settings, message) -> None:
    from mergekit_darts.config import parse_surgery

    with pytest.raises(DartsError) as err:
        parse_surgery(block_of(tmp_path, ["a", "b"], **settings))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_default_leaves_out_a_plain_kind_the_engines_would_lose(tmp_path: Path) -> None:
    """On Gemma (whose GGUF drops an untied head) the default candidates have no head; a head
    the user writes is refused (tests/test_plain_export.py)."""
    import dataclasses

    from mergekit_darts.config import parse_surgery, resolve_tasks

    (task,) = resolve_tasks(parse_surgery(block_of(tmp_path, ["a"])))
    assert [c.module for c in task.candidates()][-2:] == ["head", "norm"]
    gemma = dataclasses.replace(task, model_type="gemma2")
    assert "head" not in [c.module for c in gemma.candidates()]
    assert [c.module for c in gemma.candidates()][-1] == "norm"
    (plain,) = resolve_tasks(parse_surgery(block_of(tmp_path, ["a"], plain=True)))
    kinds = [c.module for c in dataclasses.replace(plain, model_type="gemma").candidates()]
    assert kinds == ["none", "norm"]
