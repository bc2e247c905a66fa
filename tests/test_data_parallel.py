"""``hf-darts`` through lm-eval's real data-parallel path: two CPU processes against one.

What is shimmed: ``tests/dp_shim/sitecustomize.py`` (on ``PYTHONPATH`` of the launched processes)
makes ``torch.cuda.device_count()``, when lm-eval's ``huggingface.py`` calls it, return the number
of launched processes, because HFLM takes its data-parallel branch only when it counts more than one
GPU. What stays real: ``accelerate launch`` (its torchrun-based launcher) with accelerate's own
``ACCELERATE_USE_CPU`` switch, so the Accelerator runs MULTI_CPU on gloo; HFLM's rank and world
size from that Accelerator; lm-eval's per-rank document split, request padding, per-call gathers
(``loglikelihood_rolling`` gathers window counts) and the gather of samples and metrics on rank 0;
the tiny model, the surgery modules and ``hf-darts`` itself.

``accelerate launch --cpu --num_processes 2`` is not used: accelerate sends ``--cpu`` to its simple
launcher, which starts one process (several only through ``--mpirun_hostfile`` and MPI), so that
command evaluates everything in one process.

Each configuration runs once with two processes and once with one (plain ``python -m lm_eval``);
``--limit 5`` gives every task 5 documents, 3 on rank 0 and 2 on rank 1. ``--batch_size 1`` gives
each request the same shape in both runs, so loglikelihoods and generations must be identical.
The last test runs HFLM's tensor-parallel path (``tp_plan``) under ``torchrun``, unshimmed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tiny
import torch

TESTS = Path(__file__).parent
TASKS_DIR = TESTS / "lm_eval_tasks"
SHIM = TESTS / "dp_shim"
MC, GEN, PPL = "darts_tiny_mc", "darts_tiny_gen", "darts_tiny_ppl"
TASKS = (MC, GEN, PPL)
LIMIT, WORLD = 5, 2  # 5 documents per task: 3 on rank 0, 2 on rank 1
KINDS = {"code": "pos_corr", "math": "pos_corr"}
SURGERY_MAP = (
    f"{MC}:math;{GEN}:code;{PPL}:math"  # two lm-eval tasks on one module, one on the other
)
CONFIGS = {"auto": f"surgery=auto,surgery_map={SURGERY_MAP}", "routed": "surgery=routed"}
PYTHON = Path(sys.executable)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def merged(tiny_family: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder whose surgery folder holds two random modules and a random router."""
    folder = tmp_path_factory.mktemp("dp") / "merged"
    shutil.copytree(tiny_family.math, folder)
    tiny.write_routed_surgery(folder / "surgery", 64, KINDS, rank=4, max_positions=12, seed=3)
    return folder


def launch(processes: int, port: int) -> list[str]:
    """The command line that starts lm-eval in ``processes`` processes."""
    if processes == 1:
        return [str(PYTHON), "-m", "lm_eval"]
    return [
        str(PYTHON.parent / "accelerate"), "launch", "--multi_gpu",
        "--num_processes", str(processes), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(port), "-m", "lm_eval",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(merged: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], Any]:
    """Every configuration with two processes and with one, all started together."""
    out = tmp_path_factory.mktemp("dp_out")
    path = os.pathsep.join([str(SHIM), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = os.environ | {"PYTHONPATH": path, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    env |= {"LMEVAL_LOG_LEVEL": "DEBUG"}  # for lm-eval's per-rank request counts
    procs = {}
    for port, (key, (config, processes)) in enumerate(
        ((f"{c}-{n}", (c, n)) for c in CONFIGS for n in (WORLD, 1)), start=29531
    ):
        args = f"pretrained={merged},{CONFIGS[config]},dtype=float32"
        procs[(config, processes)] = subprocess.Popen(
            [
                *launch(processes, port),
                "--model",
                "hf-darts",
                "--model_args",
                args,
                "--tasks",
                ",".join(TASKS),
                "--include_path",
                ".",
                "--limit",
                str(LIMIT),
                "--batch_size",
                "1",
                "--log_samples",
                "--output_path",
                str(out / key),
            ],  # fmt: skip
            cwd=TASKS_DIR,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        logs = {key: proc.communicate(timeout=540)[0] for key, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()  # only matters after a timeout
    for key, proc in procs.items():
        assert proc.returncode == 0, logs[key][-4000:]
    return {(config, n): (logs[(config, n)], out / f"{config}-{n}") for config, n in procs}


def samples(folder: Path, task: str) -> list[Any]:
    """(doc_id, filtered responses) of every logged document, in document order."""
    (path,) = folder.glob(f"**/samples_{task}_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted((r["doc_id"], r["filtered_resps"]) for r in rows)


def results(folder: Path) -> dict[str, Any]:
    (path,) = folder.glob("**/results_*.json")
    return json.loads(path.read_text())


def requests_per_rank(log: str) -> dict[str, list[int]]:
    """lm-eval's own count of each rank's requests per task (one line per rank and task)."""
    found: dict[str, list[int]] = {}
    for task, count in re.findall(r"Task: (\w+); number of requests on this rank: (\d+)", log):
        found.setdefault(task, []).append(int(count))
    return {task: sorted(counts) for task, counts in found.items()}


def expected_requests(task: str, rank: int, world: int) -> int:
    """Requests of the documents lm-eval gives ``rank`` (every ``world``-th from ``rank``)."""
    data = GEN if task == PPL else task  # darts_tiny_ppl reads darts_tiny_gen's documents
    lines = (TASKS_DIR / f"{data}.jsonl").read_text().splitlines()[:LIMIT]
    docs = [json.loads(line) for line in lines][rank::world]
    return sum(len(doc["choices"]) for doc in docs) if task == MC else len(docs)


@pytest.mark.parametrize("config", CONFIGS)
def test_each_rank_evaluates_only_its_share(runs: dict, config: str) -> None:
    log, _ = runs[(config, WORLD)]
    assert all(f"Building contexts for {t} on rank 1" in log for t in TASKS), log[-4000:]
    expected = {t: sorted(expected_requests(t, r, WORLD) for r in range(WORLD)) for t in TASKS}
    assert requests_per_rank(log) == expected
    single, _ = runs[(config, 1)]
    assert requests_per_rank(single) == {t: [expected_requests(t, 0, 1)] for t in TASKS}
    assert "on rank 1" not in single


@pytest.mark.parametrize("config", CONFIGS)
def test_two_processes_score_like_one(runs: dict, config: str) -> None:
    (_, two), (_, one) = runs[(config, WORLD)], runs[(config, 1)]
    for task in TASKS:
        got, want = samples(two, task), samples(one, task)
        assert [doc for doc, _ in got] == list(range(LIMIT))
        assert got == want, task
    got, want = results(two), results(one)
    assert got["results"] == want["results"]
    assert got["config"]["darts_surgery"] == ("auto" if config == "auto" else "routed")


def test_configurations_differ(runs: dict) -> None:
    """The modules act: auto and routed score the loglikelihood tasks differently."""
    for task in (MC, PPL):
        auto, routed = (samples(runs[(c, 1)][1], task) for c in CONFIGS)
        assert auto != routed, task


# --- tensor parallel: HFLM's tp_plan path under torchrun ---------------------------------------


def test_tensor_parallel_logits_match_one_process(merged: Path, tmp_path: Path) -> None:
    """``hf-darts`` with ``tp_plan=auto`` on two CPU processes (gloo), nothing shimmed.

    transformers shards every decoder layer and the LM head (vocabulary split 33 + 32 over the
    two ranks, its output gathered); the correction hooks the head's input, the replicated full
    hidden state. Each rank's logits must equal the float64 reference and one-process hf-darts.
    """
    from safetensors.torch import load_file
    from test_hf_darts import reference_logits
    from transformers import AutoModelForCausalLM

    from lm_eval_darts.model import DartsHFLM

    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    }
    run = subprocess.run(
        [
            str(PYTHON.parent / "torchrun"),
            "--nproc_per_node",
            str(WORLD),
            "--master_port",
            "29541",
            str(TESTS / "tp_worker.py"),
            str(merged),
            "math",
            str(tmp_path),
        ],  # fmt: skip
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    one = DartsHFLM(pretrained=str(merged), surgery="math", device="cpu", dtype="float32")
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    vocab, hidden = plain.config.vocab_size, plain.config.hidden_size
    module = one.surgery.modules["math"]
    shapes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert all(s["tp_size"] == WORLD and s["q_proj"] == [hidden // WORLD, hidden] for s in shapes)
    head_rows = [s["lm_head"][0] for s in shapes]  # each rank holds part of the vocabulary
    assert sum(head_rows) == vocab and max(head_rows) < vocab
    for rank in range(WORLD):
        logits = load_file(tmp_path / f"rank{rank}.safetensors")
        for i, prompt in enumerate(tiny.PROMPTS):
            ids = one.tok_encode(prompt)
            got = logits[f"p{i}"]
            assert got.shape == (len(ids), vocab)
            torch.testing.assert_close(
                got.double(), reference_logits(plain, module, ids), rtol=0, atol=1e-5
            )
            torch.testing.assert_close(
                got, one._model_call(torch.tensor([ids]))[0], rtol=0, atol=1e-5
            )
