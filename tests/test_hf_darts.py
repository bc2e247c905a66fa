"""``hf-darts`` through the real lm-eval on tiny local models and the tasks in ``lm_eval_tasks/``.

The surgery folder is written directly (random, non-zero module weights, position rows included),
so these tests do not depend on the calibration pipeline.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import tiny
import torch
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from peft import LoraConfig, get_peft_model
from reference import GEN, MC, MC_COPY, PPL, instance, pos_corr_logits64
from sqlitedict import SqliteDict
from transformers import AutoModelForCausalLM

from lm_eval_darts.model import DartsHFLM
from mergekit_darts import SurgeryModule
from mergekit_darts.errors import ModelArgsError, SurgeryFormatError
from mergekit_darts.task_map import parse_surgery_map

TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"
HIDDEN, RANK, MAX_POSITIONS = 64, 4, 12  # prompts run past 12 tokens: b_p = 0 there is exercised
BIN = Path(sys.executable).parent
NO_HOOK = {"DARTS_NO_HOOK": "1"}


def write_surgery(folder: Path, eval_tasks: dict[str, list[str]], vocab_size: int) -> Path:
    """One pos_corr task per name (every weight random and non-zero, so the correction is
    visible), routed to its lm-eval tasks."""
    modules = tiny.random_modules(
        dict.fromkeys(eval_tasks, "pos_corr"), HIDDEN, RANK, MAX_POSITIONS
    )
    entries = {
        name: {
            "loss": "ewl1",
            "steps": 0,
            "lr": 1e-3,
            "seed": 0,
            "target": f"./{name}",
            "eval_tasks": eval_tasks[name],
            "calibration": {},
            "metrics": {},
        }
        for name in eval_tasks
    }
    return tiny.write_surgery(folder, modules, entries=entries, vocab_size=vocab_size)


@pytest.fixture(scope="module")
def merged(tiny_family: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder with a two-task surgery folder, laid out as the mergekit step writes it."""
    folder = tmp_path_factory.mktemp("darts") / "merged"
    shutil.copytree(tiny_family.math, folder)
    vocab_size = AutoModelForCausalLM.from_pretrained(folder).config.vocab_size
    write_surgery(folder / "surgery", {"math": [MC, PPL], "code": [GEN, MC_COPY]}, vocab_size)
    return folder


@pytest.fixture(scope="module")
def evaluate() -> Callable[..., dict[str, list[Any]]]:
    """Run lm-eval in process; returns {task: per-document responses}, memoised per call."""
    task_manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    memo: dict[tuple, dict[str, list[Any]]] = {}

    def run(
        model_args: dict[str, Any], tasks: list[str], model: str = "hf-darts", batch_size: int = 8
    ) -> dict[str, list[Any]]:
        key = (model, json.dumps(model_args, sort_keys=True), tuple(tasks), batch_size)
        if key not in memo:
            with contextlib.chdir(TASKS_DIR):  # the task YAMLs name their data relative to it
                out = simple_evaluate(
                    model=model,
                    model_args={"device": "cpu", "dtype": "float32", **model_args},
                    tasks=tasks,
                    batch_size=batch_size,
                    task_manager=task_manager,
                    bootstrap_iters=0,
                    log_samples=True,
                )
            memo[key] = {
                task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
                for task, samples in out["samples"].items()
            }
            memo[key]["config"] = out["config"]
        return memo[key]

    return run


# --- the correction itself, against an independent float64 computation ----------------------


def reference_logits(plain: Any, module: SurgeryModule, ids: list[int]) -> torch.Tensor:
    """The float64 reference for one unpadded sequence."""
    return pos_corr_logits64(plain, module, torch.tensor([ids]))[0]


@pytest.fixture(scope="module")
def darts_lm(merged: Path) -> DartsHFLM:
    return DartsHFLM(pretrained=str(merged), surgery="math", device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def plain(merged: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()


def test_logits_match_float64_reference(darts_lm: DartsHFLM, plain: Any, tiny_family: Any) -> None:
    module = darts_lm.surgery.modules["math"]
    seqs = [darts_lm.tok_encode(p) for p in tiny_family.prompts]
    refs = [reference_logits(plain, module, ids) for ids in seqs]
    width = max(map(len, seqs))
    assert width > MAX_POSITIONS
    pad = darts_lm.tokenizer.pad_token_id

    # lm-eval's loglikelihood path: right padding, no attention mask
    right = torch.tensor([ids + [pad] * (width - len(ids)) for ids in seqs])
    logits = darts_lm._model_call(right).double()
    for row, ids, ref in zip(logits, seqs, refs, strict=True):
        torch.testing.assert_close(row[: len(ids)], ref, rtol=0, atol=1e-4)

    # generation's prefill: left padding with an attention mask
    left = torch.tensor([[pad] * (width - len(ids)) + ids for ids in seqs])
    mask = (torch.arange(width) >= width - torch.tensor([len(s) for s in seqs])[:, None]).long()
    with torch.no_grad():
        logits = darts_lm.model(input_ids=left, attention_mask=mask).logits.double()
    for row, ids, ref in zip(logits, seqs, refs, strict=True):
        torch.testing.assert_close(row[width - len(ids) :], ref, rtol=0, atol=1e-4)

    with torch.no_grad():
        uncorrected = plain(torch.tensor([seqs[0]])).logits[0].double()
    assert (uncorrected - refs[0]).abs().max() > 0.5  # the surgery really changes the logits


def test_set_surgery_swaps_modules_without_reloading(
    merged: Path, plain: Any, tiny_family: Any, tmp_path: Path
) -> None:
    """A sweep keeps one model and swaps modules: each swap gives that module's own logits."""
    lm = DartsHFLM(pretrained=str(merged), surgery="none", device="cpu", dtype="float32")
    model = lm.model
    ids = lm.tok_encode(tiny_family.prompts[0])
    with torch.no_grad():
        uncorrected = plain(torch.tensor([ids])).logits[0].double()
    for task in ("math", "code"):
        lm.set_surgery(task, str(merged / "surgery"))
        ref = reference_logits(plain, lm.surgery.modules[task], ids)
        torch.testing.assert_close(
            lm._model_call(torch.tensor([ids]))[0].double(), ref, atol=1e-4, rtol=0
        )
    lm._leakage.counts["earlier_cell"] = 3
    lm.set_surgery("none")
    assert lm._leakage.counts == {}  # each set of modules reports its own calibration overlap
    torch.testing.assert_close(lm._model_call(torch.tensor([ids]))[0].double(), uncorrected)
    with pytest.raises(SurgeryFormatError, match="no surgery manifest"):
        lm.set_surgery("auto", str(tmp_path))
    assert lm.surgery.mode == "none" and lm.model is model  # unchanged, never reloaded


def test_lm_eval_requests_match_reference(
    darts_lm: DartsHFLM, plain: Any, tiny_family: Any
) -> None:
    module = darts_lm.surgery.modules["math"]
    pairs = [(p.rsplit(" ", 2)[0], " " + " ".join(p.split()[-2:])) for p in tiny_family.prompts]
    got = darts_lm.loglikelihood([instance("loglikelihood", pair) for pair in pairs])
    for (context, continuation), (logprob, _) in zip(pairs, got, strict=True):
        ctx, cont = darts_lm._encode_pair(context, continuation)
        ref = torch.log_softmax(reference_logits(plain, module, ctx + cont[:-1]), -1)
        expected = ref[-len(cont) :].gather(1, torch.tensor(cont)[:, None]).sum()
        assert logprob == pytest.approx(float(expected), abs=1e-4)

    steps = 6
    gen_kwargs = {"until": ["never seen"], "max_gen_toks": steps, "do_sample": False}
    prompts = tiny_family.prompts[:8]
    got = darts_lm.generate_until([instance("generate_until", (p, gen_kwargs)) for p in prompts])
    eos = darts_lm.tokenizer.eos_token_id
    for prompt, text in zip(prompts, got, strict=True):
        ids = darts_lm.tok_encode(prompt)
        new: list[int] = []
        while len(new) < steps and (not new or new[-1] != eos):
            new.append(int(reference_logits(plain, module, ids + new)[-1].argmax()))
        assert text == darts_lm.tok_decode([t for t in new if t != eos])


@pytest.mark.parametrize(
    ("options", "tol"),
    [({"parallelize": True}, 0.0), ({"dtype": "bfloat16"}, 0.1)],
    ids=["parallelize", "bfloat16"],
)
def test_hf_loading_options(
    darts_lm: DartsHFLM, merged: Path, tmp_path: Path, options: dict, tol: float
) -> None:
    """accelerate's device map (here: CPU-only, so offloaded) and half precision keep working."""
    args = {"pretrained": str(merged), "surgery": "math", "device": "cpu", "dtype": "float32"}
    lm = DartsHFLM(**(args | options), offload_folder=str(tmp_path))
    requests = [instance("loglikelihood", ("the sun and the", " moon river"))]
    got, expected = lm.loglikelihood(requests)[0][0], darts_lm.loglikelihood(requests)[0][0]
    assert got == pytest.approx(expected, abs=tol)


# --- through lm-eval's evaluator -------------------------------------------------------------


def assert_same_up_to_float_noise(a: Any, b: Any, tol: float = 1e-5) -> None:
    """Equal structure, strings and flags; floats within ``tol``.

    The tiny model alone is not bit-identical across padded batch shapes on CPU (GEMM blocking
    follows the shape; ``hf`` itself moves by ~1e-7 per logit), so loglikelihoods get a tolerance
    four orders of magnitude below what one wrong position row would cost.
    """
    if isinstance(a, float):
        assert a == pytest.approx(b, abs=tol)
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_up_to_float_noise(x, y, tol)
    else:
        assert a == b


@pytest.mark.slow
def test_batch_size_does_not_change_results(evaluate: Callable, merged: Path) -> None:
    args = {"pretrained": str(merged), "surgery": "math"}
    one = evaluate(args, [MC, GEN, PPL], batch_size=1)
    eight = evaluate(args, [MC, GEN, PPL], batch_size=8)
    assert one[GEN] == eight[GEN]  # generations: left padding + KV cache, exactly equal
    for task in (MC, PPL):
        assert_same_up_to_float_noise(one[task], eight[task])


@pytest.mark.slow
@pytest.mark.parametrize("none", [None, "none"])
def test_surgery_none_equals_hf(evaluate: Callable, merged: Path, none: str | None) -> None:
    hf = evaluate({"pretrained": str(merged)}, [MC, GEN], model="hf")
    darts = evaluate({"pretrained": str(merged), "surgery": none}, [MC, GEN])
    with_math = evaluate({"pretrained": str(merged), "surgery": "math"}, [MC, GEN, PPL])
    for task in (MC, GEN):
        assert darts[task] == hf[task]
    assert with_math[MC] != hf[MC]


def test_surgery_none_from_a_model_args_string(merged: Path) -> None:
    """``simple_evaluate(model_args="...,surgery=none")`` hands over None, not "none"."""
    lm = DartsHFLM.create_from_arg_string(f"pretrained={merged},surgery=none,device=cpu")
    assert lm.surgery.mode == "none"


@pytest.mark.slow
def test_auto_and_surgery_map_route_each_task(evaluate: Callable, merged: Path) -> None:
    tasks = [MC, MC_COPY, GEN, PPL]
    math = evaluate({"pretrained": str(merged), "surgery": "math"}, [MC, GEN, PPL])
    code = evaluate({"pretrained": str(merged), "surgery": "code"}, [MC, GEN, PPL])
    assert all(math[task] != code[task] for task in (MC, GEN, PPL))

    # manifest routing: MC, PPL -> math; MC_COPY, GEN -> code. MC and MC_COPY are the same requests
    auto = evaluate({"pretrained": str(merged), "surgery": "auto"}, tasks)
    assert auto[MC] == math[MC] and auto[PPL] == math[PPL]
    assert auto[MC_COPY] == code[MC] and auto[GEN] == code[GEN]
    assert auto["config"]["darts_surgery"] == "auto"

    swapped = f"{MC}:code;{MC_COPY}:math;darts_tiny_g*:math;{PPL}:code"
    mapped = evaluate({"pretrained": str(merged), "surgery_map": swapped}, tasks)
    assert mapped[MC] == code[MC] and mapped[PPL] == code[PPL]
    assert mapped[MC_COPY] == math[MC] and mapped[GEN] == math[GEN]

    hf = evaluate({"pretrained": str(merged)}, [MC], model="hf")
    partly = evaluate(
        {"pretrained": str(merged), "surgery_map": f"{MC}:none;{MC_COPY}:code"}, tasks[:2]
    )
    assert partly[MC] == hf[MC]
    assert partly[MC_COPY] == code[MC]


def test_default_is_the_only_task(tmp_path: Path, merged: Path) -> None:
    folder = write_surgery(tmp_path / "surgery", {"solo": [MC]}, 100)
    lm = DartsHFLM(pretrained=str(merged), surgery_path=str(folder), device="cpu")
    assert lm.surgery.mode == "solo"
    assert lm._handle is not None and lm._handle.module is lm.surgery.modules["solo"]


# --- errors: one line, before the model is loaded ----------------------------------------------


@pytest.mark.parametrize(
    ("model_args", "error", "message"),
    [
        (
            {"surgery": "physics"},
            SurgeryFormatError,
            "no surgery task 'physics'.*available: math, code",
        ),
        ({}, ValueError, "holds surgery tasks math, code: choose surgery=<task>, surgery=auto"),
        (
            {"surgery_map": "darts_tiny_mc=math"},
            ValueError,
            "bad surgery_map entry 'darts_tiny_mc=math'",
        ),
        ({"surgery_map": "a:math;a:code"}, ValueError, "maps 'a' twice"),
        (
            {"surgery_map": "a:physics"},
            SurgeryFormatError,
            "physics not in .*available: math, code",
        ),
        (
            {"surgery": "math", "surgery_map": "a:math"},
            ValueError,
            "surgery_map applies to surgery=auto",
        ),
        (
            {"surgery": "none", "surgery_map": "a:math"},
            ValueError,
            "surgery_map applies to surgery=auto",
        ),
    ],
)
def test_bad_arguments_fail_before_loading(
    merged: Path, tmp_path: Path, model_args: dict, error: type, message: str
) -> None:
    # `pretrained` has no weights: reaching HFLM's model loading would raise something else
    with pytest.raises(error, match=message) as info:
        DartsHFLM(pretrained=str(tmp_path), surgery_path=str(merged / "surgery"), **model_args)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("written", "meant"),
    [("surgerypath", "surgery_path"), ("surgery_maps", "surgery_map"), ("Surgery", "surgery")],
)
def test_a_misspelled_surgery_argument_fails_before_loading(
    merged: Path, tmp_path: Path, written: str, meant: str
) -> None:
    # `pretrained` has no weights: reaching HFLM's model loading would raise something else
    with pytest.raises(ModelArgsError) as info:
        DartsHFLM(pretrained=str(tmp_path), surgery="auto", **{written: str(merged / "surgery")})
    assert str(info.value) == (
        f"hf-darts: unknown model argument {written}=; did you mean {meant}=? (hf-darts reads "
        "surgery=, surgery_path= and surgery_map=; other arguments go to lm-eval's hf model)"
    )


def test_other_unknown_arguments_still_reach_the_model(merged: Path) -> None:
    """Arguments that look nothing like ours are HFLM's (and transformers') business."""
    lm = DartsHFLM(
        pretrained=str(merged), surgery="math", device="cpu", attn_implementation="eager"
    )
    assert lm.model.config._attn_implementation == "eager"


def test_missing_surgery_folder(tiny_family: Any) -> None:
    with pytest.raises(SurgeryFormatError, match=r"no surgery manifest at .*base/surgery"):
        DartsHFLM(pretrained=str(tiny_family.base), surgery="math", device="cpu")
    # not a local folder: a hub id, whose surgery/ folder cannot be fetched offline
    with pytest.raises(SurgeryFormatError, match="could not be fetched from the hub"):
        DartsHFLM(pretrained="darts-tests/no-such-model", surgery="math", device="cpu")


@pytest.mark.slow
def test_auto_without_module_for_a_task(evaluate: Callable, merged: Path) -> None:
    with pytest.raises(ValueError, match=r"no module for lm-eval task\(s\) darts_tiny_gen; mapped"):
        evaluate({"pretrained": str(merged), "surgery_map": f"{MC}:math"}, [MC, GEN])


def test_parse_surgery_map() -> None:
    assert parse_surgery_map(" gsm8k:math ; humaneval:code;") == {
        "gsm8k": "math",
        "humaneval": "code",
    }
    assert parse_surgery_map({"mmlu_*": "none"}) == {"mmlu_*": "none"}
    with pytest.raises(ValueError, match="empty"):
        parse_surgery_map(";")


# --- the stock console scripts ---------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_runs(merged: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Three console-script runs, started together (each spends ~15 s indexing lm-eval's tasks)."""
    out = tmp_path_factory.mktemp("cli")
    common = [
        "--model", "hf-darts", "--tasks", MC, "--include_path", ".", "--device", "cpu",
        "--batch_size", "4", "--limit", "4", "--log_samples",
    ]  # fmt: skip
    math = f"pretrained={merged},surgery=math,dtype=float32"
    # the same module chosen through a surgery_map parsed from the command line
    mapped = f"pretrained={merged},surgery_map={MC}:math;{GEN}:code,dtype=float32"
    runs = {
        "stock": (["lm_eval", "--model_args", math, "--output_path", out / "stock"], {}),
        "no_hook": (["lm_eval", "--model_args", math, "--output_path", out / "no_hook"], NO_HOOK),
        "fallback": (
            ["lm-eval-darts", "--model_args", mapped, "--output_path", out / "map"],
            NO_HOOK,
        ),
    }
    env = {k: v for k, v in os.environ.items() if k != "DARTS_NO_HOOK"} | {"OMP_NUM_THREADS": "1"}
    procs = {}
    for name, ((script, *args), extra_env) in runs.items():
        procs[name] = subprocess.Popen(
            [str(BIN / script), *common, *map(str, args)],
            cwd=TASKS_DIR,
            env=env | extra_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        logs = {name: proc.communicate(timeout=300)[0] for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()  # only matters after a timeout
    return {name: (logs[name], proc.returncode) for name, proc in procs.items()} | {"out": out}


def cli_samples(folder: Path) -> list[Any]:
    """Per-document responses from ``--log_samples`` output, whose numbers are written as strings."""

    def parse(value: Any) -> Any:
        if isinstance(value, list):
            return [parse(v) for v in value]
        return value == "True" if value in ("True", "False") else float(value)

    (path,) = folder.glob(f"**/samples_{MC}_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [parse(r["resps"]) for r in sorted(rows, key=lambda r: r["doc_id"])]


@pytest.mark.slow
def test_stock_lm_eval_finds_hf_darts(
    cli_runs: dict[str, Any], evaluate: Callable, merged: Path
) -> None:
    log, rc = cli_runs["stock"]
    assert rc == 0, log
    (results,) = (cli_runs["out"] / "stock").glob("**/results_*.json")
    config = json.loads(results.read_text())["config"]
    assert config["model"] == "hf-darts" and config["darts_surgery"] == "math"
    in_process = evaluate({"pretrained": str(merged), "surgery": "math"}, [MC], batch_size=4)
    assert_same_up_to_float_noise(cli_samples(cli_runs["out"] / "stock"), in_process[MC][:4])


@pytest.mark.slow
def test_darts_no_hook_turns_registration_off(cli_runs: dict[str, Any]) -> None:
    log, rc = cli_runs["no_hook"]
    assert rc != 0 and "hf-darts" in log and "no model for this name found" in log


@pytest.mark.slow
def test_lm_eval_darts_command(cli_runs: dict[str, Any]) -> None:
    log, rc = cli_runs["fallback"]
    assert rc == 0, log
    assert cli_samples(cli_runs["out"] / "map") == cli_samples(cli_runs["out"] / "stock")


# --- calibration leakage ---------------------------------------------------------------------

# Two docs of darts_tiny_gen (and so of darts_tiny_ppl, which reads the same file); no
# darts_tiny_mc request contains either.
LEAKED = ["water and fire and stone and tree", "def mul ( k , l ) : return k times l"]


@pytest.fixture(scope="module")
def leaky_surgery(merged: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-task surgery folder whose diagnostics hold LEAKED (+ a prompt no task uses),
    tokenized the way the pipeline stores them: BOS first, right-padded, with a mask."""
    from safetensors.torch import save
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged)
    rows = [tokenizer(text)["input_ids"] for text in [*LEAKED, "red green blue moon tree"]]
    width = max(map(len, rows))
    ids = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in rows])
    mask = torch.tensor([[i < len(row) for i in range(width)] for row in rows])
    folder = tmp_path_factory.mktemp("leaky") / "surgery"
    write_surgery(folder, {"math": [MC]}, 65)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["tasks"]["math"]["diagnostics"] = "diagnostics/math.safetensors"
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "diagnostics").mkdir()
    (folder / "diagnostics" / "math.safetensors").write_bytes(
        save({"input_ids": ids, "mask": mask})
    )
    return folder


@pytest.mark.slow
def test_calibration_prompts_in_eval_requests_are_reported(
    evaluate: Callable, merged: Path, leaky_surgery: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = {"pretrained": str(merged), "surgery_path": str(leaky_surgery), "surgery": "math"}
    with caplog.at_level("WARNING"):
        out = evaluate(args, [MC, GEN, PPL])
    assert out["config"]["darts_calibration_overlap"] == {MC: 0, GEN: 2, PPL: 2}
    warnings = [r.getMessage() for r in caplog.records if "calibration prompts" in r.getMessage()]
    assert len(warnings) == 2, warnings  # one per leaking task, none for the clean one
    assert any(f"2 of 10 requests of lm-eval task {GEN}" in w for w in warnings)
    assert any(f"lm-eval task {PPL}" in w for w in warnings)
    assert not any(MC in w for w in warnings)


@pytest.mark.slow
def test_no_diagnostics_no_overlap_check(
    evaluate: Callable, merged: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        out = evaluate({"pretrained": str(merged), "surgery": "math"}, [MC])
    assert out["config"]["darts_calibration_overlap"] == {}
    assert not [r for r in caplog.records if "calibration prompts" in r.getMessage()]


def test_calibration_grams() -> None:
    """13-token windows of long sequences, whole short sequences, nothing shorter."""
    from lm_eval_darts.leakage import CalibrationGrams

    long, short = list(range(100, 120)), [7, 8, 9]
    grams = CalibrationGrams([long, short])
    assert grams.found_in([1, 2, *long[3:16], 5])  # 13 consecutive calibration tokens
    assert not grams.found_in([1, 2, *long[3:15], 5])  # 12 are not enough
    assert grams.found_in([0, 7, 8, 9, 0]) and not grams.found_in([7, 8, 0, 9])
    assert not CalibrationGrams([]).found_in(long)
    cut = CalibrationGrams([long, short], cut=[True, True])  # cut by max_length
    assert cut.found_in([1, 2, *long[3:16], 5]) and not cut.found_in([0, 7, 8, 9, 0])


def test_possibly_cut_reads_the_manifest() -> None:
    """A prompt that reached max_length - continuation_tokens may have been cut."""
    from lm_eval_darts.leakage import possibly_cut

    record = {"max_length": 8, "continuation_tokens": 2, "prompt_tokens": [3, 6, 5]}
    assert possibly_cut(record, 3) == [False, True, False]
    assert possibly_cut(record, 2) == []  # rows that do not match: nothing marked
    assert possibly_cut({"max_length": 8}, 3) == []  # older manifests read as before


# ------------------------------------------------------------------------------------------------
# ``hf-darts`` never returns answers of another correction or corrects other weights.
#
# lm-eval's ``--use_cache`` keys each answer by its request alone; a run with one correction must
# not read the answers a run with another correction cached. ``peft=`` and ``delta=`` change the
# merged weights, which the surgery was calibrated on without them: refused, before the model loads.
# Runs through the stock ``lm_eval`` console script on the tiny model of ``test_hf_darts``.


LIMIT = 4


def lm_eval_cli(merged: Path, surgery: str, cache: Path, output: Path) -> None:  # noqa: F811
    command = [
        str(BIN / "lm_eval"), "--model", "hf-darts",
        "--model_args", f"pretrained={merged},surgery={surgery},dtype=float32",
        "--tasks", MC, "--include_path", ".", "--device", "cpu", "--batch_size", "4",
        "--limit", str(LIMIT), "--log_samples", "--use_cache", str(cache),
        "--output_path", str(output),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "DARTS_NO_HOOK"} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        command, cwd=TASKS_DIR, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def floats(value: Any) -> list[float]:
    """The loglikelihoods in lm-eval's nested responses, in order."""
    if isinstance(value, float):
        return [value]
    if isinstance(value, list | tuple):
        return [x for item in value for x in floats(item)]
    return []


def cached_answers(cache: Path) -> int:
    with SqliteDict(f"{cache}_rank0.db") as database:
        return len(database)


@pytest.mark.slow
def test_use_cache_keeps_the_answers_of_each_correction_apart(
    merged: Path,  # noqa: F811
    evaluate: Callable,  # noqa: F811
    tmp_path: Path,
) -> None:
    fresh = {
        task: evaluate({"pretrained": str(merged), "surgery": task}, [MC], batch_size=4)[MC]
        for task in ("math", "code")
    }
    differ = [abs(a - b) for a, b in zip(floats(fresh["math"]), floats(fresh["code"]), strict=True)]
    assert max(differ) > 1e-2  # a cached answer of the other correction would show

    cache = tmp_path / "cache" / "lm"
    lm_eval_cli(merged, "math", cache, tmp_path / "math")
    filled = cached_answers(cache)
    assert filled > 0
    lm_eval_cli(merged, "code", cache, tmp_path / "code")  # the cache holds math's answers
    assert_same_up_to_float_noise(cli_samples(tmp_path / "math"), fresh["math"][:LIMIT])
    assert_same_up_to_float_noise(cli_samples(tmp_path / "code"), fresh["code"][:LIMIT])
    assert cached_answers(cache) == 2 * filled

    # the same correction again reads its own answers: nothing new is computed or stored
    from lm_eval import simple_evaluate

    with contextlib.chdir(TASKS_DIR):
        simple_evaluate(
            model="hf-darts",
            model_args={"pretrained": str(merged), "surgery": "code", "dtype": "float32"},
            tasks=[MC],
            limit=LIMIT,
            batch_size=4,
            device="cpu",
            use_cache=str(cache),
            bootstrap_iters=0,
            task_manager=evaluate_task_manager(),
        )
    assert cached_answers(cache) == 2 * filled


def evaluate_task_manager() -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR), include_defaults=False)


@pytest.fixture(scope="module")
def adapter(merged: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """A real LoRA adapter of the merged model, saved by peft."""
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    config = LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj", "v_proj"])
    folder = tmp_path_factory.mktemp("adapter") / "lora"
    get_peft_model(model, config).save_pretrained(folder)
    return folder


def test_peft_and_delta_with_a_surgery_are_refused(
    merged: Path,  # noqa: F811
    adapter: Path,
    tiny_family: Any,
) -> None:
    for name, value in {"peft": adapter, "delta": tiny_family.code}.items():
        for surgery in ("math", "auto"):
            with pytest.raises(ModelArgsError) as info:
                DartsHFLM(pretrained=str(merged), surgery=surgery, device="cpu", **{name: value})
            message = str(info.value)
            assert f"{name}={value}" in message and "calibrated on" in message
            assert "surgery=none" in message and "\n" not in message
    lm = DartsHFLM(pretrained=str(merged), surgery="none", peft=str(adapter), device="cpu")
    with pytest.raises(ModelArgsError, match="peft="):  # nor switched on afterwards
        lm.set_surgery("math")
    assert lm.surgery.mode == "none"
