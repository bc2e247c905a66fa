"""Inputs a new user tries that must end in one line or complete: a peft adapter without a task
type, empty documents, a report with nowhere to go, a context too short for ``max_length``,
symbolic links in the way of a write, and a merged folder that cannot be written."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiny
import torch
import yaml
from click.testing import CliRunner
from reference import pos_corr_logits64
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from mergekit_darts.apply import SurgeryHandle
from mergekit_darts.calibrate.store import CaptureStore
from mergekit_darts.cli import main as darts_cli
from mergekit_darts.errors import ReportError, SurgeryConfigError
from mergekit_darts.folder.artifacts import load_surgery, read_manifest, write_surgery_folder
from mergekit_darts.folder.manifest import surgery_dir
from mergekit_darts.hosts.post_merge import run_surgery
from mergekit_darts.present.report import write_report

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
HIDDEN, RANK, MAX_POSITIONS = 64, 4, 8


def listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@contextlib.contextmanager
def unwritable(folder: Path) -> Iterator[None]:
    """``folder`` refuses new entries, for root too (``chattr +i``; mode bits bind the others)."""
    if os.geteuid() != 0:
        mode = folder.stat().st_mode
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(mode)
        return
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("running as root where chattr +i is not available")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def one_line_error(result: Any) -> str:
    """The one ``Error:`` line of a failed click run (no traceback)."""
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


@pytest.fixture(scope="module")
def calibrated(tiny_family, tiny_merged, calibration_data, tmp_path_factory) -> Path:
    """A copy of the tiny merge with one task calibrated by the real pipeline (its diagnostics
    are real)."""
    merged = Path(shutil.copytree(tiny_merged, tmp_path_factory.mktemp("new_user") / "merged"))
    block = {
        "select": "off",
        "module": "pos_corr",
        "rank": RANK,
        "max_positions": 16,
        "steps": 1,
        "tasks": [
            {
                "name": "math",
                "target": str(tiny_family.math),
                "eval_tasks": ["darts_tiny_empty"],
                "calibration": {
                    "path": str(calibration_data / "math.jsonl"),
                    "field": "question",
                    "max_length": 16,
                },
            }
        ],
    }
    run_surgery(merged, block, progress=False, write_card=False)
    return merged


def edited_surgery(merged: Path, folder: Path, value: Any) -> Path:
    """``folder``: a copy of ``merged``'s surgery/ (diagnostics included) whose math module has
    every tensor set to ``value`` (a float, or a function of the tensor's size)."""
    source = surgery_dir(merged)
    module = load_surgery(source, "math")
    with torch.no_grad():
        for tensor in module.parameters():
            fill = (
                value(tensor.numel()) if callable(value) else torch.full((tensor.numel(),), value)
            )
            tensor.copy_(fill.view_as(tensor))
    diagnostics = "diagnostics/math.safetensors"
    manifest = read_manifest(source).to_dict()
    extra = {diagnostics: (source / diagnostics).read_bytes()}
    return write_surgery_folder(folder, {"math": module}, manifest, extra_files=extra)


# --- a peft adapter without task_type: forward(*args, **kwargs) hides the positions -----------


class Wrapper(nn.Module):
    """What peft's generic ``PeftModel`` looks like to a hook: ``forward(*args, **kwargs)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def get_output_embeddings(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny.tiny_config(50)).eval()


IDS = torch.tensor([[2, 5, 6, 7, 8, 9, 10, 11, 12, 13], [2, 14, 15, 16, 17, 18, 19, 20, 21, 22]])


def test_a_wrapper_called_positionally_or_by_keyword_is_corrected_alike(llama):
    module = tiny.random_module("pos_corr", HIDDEN, RANK, MAX_POSITIONS, seed=3)
    expected = pos_corr_logits64(llama, module, IDS)
    wrapper = Wrapper(llama)
    with SurgeryHandle(wrapper, module), torch.no_grad():
        by_position = wrapper(IDS).logits
        by_keyword = wrapper(input_ids=IDS).logits
    torch.testing.assert_close(by_position.double(), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(by_keyword.double(), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_a_peft_model_is_corrected_in_forward_and_generate(llama, task_type):
    """The generic PeftModel (no task_type) and PeftModelForCausalLM, whose ``generate`` calls
    the wrapped model directly, bypassing the wrapper's own forward."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        LlamaForCausalLM(llama.config).eval(),
        peft.LoraConfig(
            r=2, target_modules=["q_proj"], task_type=task_type, init_lora_weights=False
        ),
    ).eval()
    module = tiny.random_module("pos_corr", HIDDEN, RANK, MAX_POSITIONS, seed=4)
    expected = pos_corr_logits64(model, module, IDS)
    with SurgeryHandle(model, module), torch.no_grad():
        by_position = model(IDS).logits
        by_keyword = model(input_ids=IDS).logits
        generated = model.generate(
            input_ids=IDS,
            attention_mask=torch.ones_like(IDS),
            max_new_tokens=1,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    torch.testing.assert_close(by_position.double(), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(by_keyword.double(), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(generated.logits[0].double(), expected[:, -1], atol=1e-4, rtol=0)


# --- empty documents of a loglikelihood_rolling task ---------------------------------------------


@pytest.mark.slow
def test_empty_documents_score_as_with_hf(calibrated, tmp_path):
    """With a module that corrects nothing (every weight zero) the score is hf's; the leakage
    check reads the real calibration diagnostics beside it."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    folder = edited_surgery(calibrated, tmp_path / "surgery", 0.0)
    task_manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    scores = {}
    darts = {"surgery": "math", "surgery_path": str(folder)}
    for model, extra in (("hf", {}), ("hf-darts", darts)):
        with contextlib.chdir(TASKS_DIR):
            out = simple_evaluate(
                model=model,
                model_args={"pretrained": str(calibrated), "device": "cpu", **extra},
                tasks=["darts_tiny_empty"],
                task_manager=task_manager,
                bootstrap_iters=0,
            )
        scores[model] = out["results"]["darts_tiny_empty"]["word_perplexity,none"]
    assert scores["hf-darts"] == pytest.approx(scores["hf"], rel=1e-6)


# --- mergekit-darts report: nowhere to write, unreadable diagnostics, links in the way ------


@pytest.fixture
def merged(calibrated, tmp_path) -> Path:
    return Path(shutil.copytree(calibrated, tmp_path / "merged", symlinks=True))


@pytest.mark.slow
def test_report_in_a_folder_that_cannot_be_written_is_one_line(merged):
    with unwritable(surgery_dir(merged)):
        line = one_line_error(CliRunner().invoke(darts_cli, ["report", str(merged), "--quiet"]))
    assert line.startswith(f"Error: cannot write the report to {surgery_dir(merged) / 'report'}")
    assert "--output" in line


@pytest.mark.slow
def test_report_output_below_a_file_is_one_line(merged, tmp_path):
    (tmp_path / "a_file").write_text("mine")
    output = tmp_path / "a_file" / "report"
    line = one_line_error(
        CliRunner().invoke(darts_cli, ["report", str(merged), "--output", str(output), "--quiet"])
    )
    assert line.startswith(f"Error: cannot write the report to {output}: Not a directory")
    assert (tmp_path / "a_file").read_text() == "mine"


@pytest.mark.slow
def test_report_on_truncated_diagnostics_names_the_file(merged):
    path = surgery_dir(merged) / "diagnostics" / "math.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    line = one_line_error(CliRunner().invoke(darts_cli, ["report", str(merged), "--quiet"]))
    assert line.startswith(f"Error: {path} is not a readable diagnostics file")
    assert "--recompute" in line


@pytest.mark.slow
@pytest.mark.parametrize("link", ["report", "report/report.md", "report/rho_l1.png"])
def test_report_refuses_a_link_in_the_way(merged, tmp_path, link):
    """A downloaded model may carry links: the report never writes through one."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "report.md").write_text("my own notes")
    (elsewhere / "rho_l1.png").write_text("my own picture")
    where = surgery_dir(merged) / link
    where.parent.mkdir(parents=True, exist_ok=True)
    where.symlink_to(elsewhere if link == "report" else elsewhere / Path(link).name)
    before = listing(elsewhere)
    with pytest.raises(ReportError) as info:
        write_report(merged, progress=False)
    assert str(info.value).startswith(f"{where} is a symbolic link (to {os.readlink(where)})")
    assert listing(elsewhere) == before


@pytest.mark.slow
def test_calibrate_refuses_a_linked_surgery_folder(merged, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(surgery_dir(merged), elsewhere)
    surgery_dir(merged).symlink_to(elsewhere)
    before = listing(elsewhere)
    store = CaptureStore(None)
    block = yaml.safe_load((elsewhere / "surgery.yml").read_text())["surgery"]
    with pytest.raises(SurgeryConfigError, match=r"surgery is a symbolic link \(to .*elsewhere\)"):
        run_surgery(merged, block, overwrite=True, progress=False, store=store)
    assert store.stats.model_loads == 0
    assert listing(elsewhere) == before


@pytest.mark.slow
def test_export_refuses_a_linked_dest(merged, tmp_path):
    from mergekit_darts.errors import ExportError
    from mergekit_darts.hosts.deploy.export import export

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dest = tmp_path / "dest"
    dest.symlink_to(elsewhere)
    with pytest.raises(ExportError, match=f"^{dest} exists and is not a folder: choose a new DEST"):
        export(merged, dest, "math")
    assert not any(elsewhere.iterdir())


@pytest.mark.slow
def test_calibrate_on_a_folder_that_cannot_be_written_stops_before_capture(merged):
    block = yaml.safe_load((surgery_dir(merged) / "surgery.yml").read_text())["surgery"]
    store = CaptureStore(None)
    before = listing(merged)
    with unwritable(merged), pytest.raises(SurgeryConfigError) as info:
        run_surgery(merged, block, overwrite=True, progress=False, write_card=False, store=store)
    assert str(info.value).startswith(f"cannot write surgery/ into {merged}: ")
    assert "\n" not in str(info.value)
    assert store.stats.model_loads == 0
    assert listing(merged) == before


# --- a calibration longer than a learned-position model's context -------------------------------


def gpt2_family(root: Path) -> dict[str, Path]:
    """A tiny GPT-2 base and target with 16 learned positions, saved with the tiny tokenizer."""
    tokenizer = tiny.build_tokenizer()
    folders = {}
    for seed, name in enumerate(("base", "math")):
        torch.manual_seed(seed)
        config = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=16,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=4,
            bos_token_id=2,
            eos_token_id=3,
            pad_token_id=0,
        )
        folders[name] = root / name
        GPT2LMHeadModel(config).save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return folders


@pytest.mark.slow
def test_max_length_beyond_learned_positions_is_refused_before_merging(tmp_path, calibration_data):
    family = gpt2_family(tmp_path)
    recipe = {
        "merge_method": "linear",
        "models": [
            {"model": str(family["base"]), "parameters": {"weight": 0.5}},
            {"model": str(family["math"]), "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
        "surgery": {
            "max_positions": 32,
            "tasks": [
                {
                    "name": "math",
                    "target": str(family["math"]),
                    "calibration": {
                        "path": str(calibration_data / "math.jsonl"),
                        "field": "question",
                        "max_length": 32,
                    },
                }
            ],
        },
    }
    config = tmp_path / "merge.yml"
    config.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    result = CliRunner().invoke(darts_cli, ["merge", str(config), str(out)])
    line = one_line_error(result)
    assert line.startswith(
        "Error: surgery.tasks[0].calibration.max_length: 32 exceeds the 16 positions the base "
    ), line
    assert line.endswith("lower max_length to 16 or less"), line
    assert not out.exists() or not any(out.iterdir())


def test_a_rotary_model_has_no_position_limit(tiny_family):
    from mergekit_darts.config.preflight import model_shape

    assert model_shape(str(tiny_family.base), "base", trust_remote_code=False).max_positions is None


def gpt2_merge(
    tmp_path: Path,
    calibration_data: Path,
    surgery: dict[str, Any],
    calibration: dict[str, Any],
    task: dict[str, Any] | None = None,
) -> tuple[Any, Path]:
    """``mergekit-darts merge`` of the 16-position GPT-2 family with one task ``math``."""
    family = gpt2_family(tmp_path)
    source = {"path": str(calibration_data / "math.jsonl"), "field": "question"}
    recipe = {
        "merge_method": "linear",
        "models": [
            {"model": str(family["base"]), "parameters": {"weight": 0.5}},
            {"model": str(family["math"]), "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
        "surgery": {
            "max_positions": 16,
            "steps": 5,
            **surgery,
            "tasks": [
                {
                    "name": "math",
                    "target": str(family["math"]),
                    "calibration": {**source, **calibration},
                    **(task or {}),
                }
            ],
        },
    }
    config = tmp_path / "merge.yml"
    config.write_text(yaml.safe_dump(recipe))
    out = tmp_path / "out"
    return CliRunner().invoke(darts_cli, ["merge", str(config), str(out)]), out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("calibration", "task", "expected"),
    [
        (  # the default verdict: 128 completion tokens cannot fit 16 positions at all
            {"max_length": 16},
            None,
            "prompts of up to 16 tokens (max_length) plus the verdict's target completions of up "
            "to 128 tokens (surgery.select.completion_tokens) exceed the 16 positions the base "
            "model {base} has (max_position_embeddings, a learned position table); lower "
            "max_length + surgery.select.completion_tokens to 16 or less, or set `select: off`",
        ),
        (  # a task's own select, with calibration completions taking part of max_length
            {"max_length": 16, "continuation_tokens": 2},
            {"select": {"completion_tokens": 4}},
            "prompts of up to 14 tokens (max_length - continuation_tokens) plus the verdict's "
            "target completions of up to 4 tokens (surgery.tasks[0].select.completion_tokens) "
            "exceed the 16 positions the base model {base} has (max_position_embeddings, a "
            "learned position table); lower surgery.tasks[0].select.completion_tokens to 2, or "
            "lower max_length to 14, or set `select: off`",
        ),
    ],
    ids=["default-select", "task-select-with-continuation"],
)
def test_verdict_completions_beyond_learned_positions_are_refused_before_merging(
    tmp_path, calibration_data, calibration, task, expected
):
    result, out = gpt2_merge(tmp_path, calibration_data, {}, calibration, task)
    line = one_line_error(result)
    base = tmp_path / "base"
    assert line == f"Error: surgery.tasks[0].calibration.max_length: {expected.format(base=base)}"
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_verdict_completions_that_just_fit_learned_positions_run(tmp_path, calibration_data):
    # 12 prompt tokens + 4 completion tokens fill the 16 positions exactly
    result, out = gpt2_merge(
        tmp_path, calibration_data, {"select": {"completion_tokens": 4}}, {"max_length": 12}
    )
    assert result.exit_code == 0, result.output
    entry = read_manifest(surgery_dir(out)).to_dict()["tasks"]["math"]
    assert max(entry["calibration"]["prompt_tokens"]) == 12
    assert entry["selection"]["completion_tokens"] == 4
