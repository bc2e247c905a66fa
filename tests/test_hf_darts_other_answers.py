"""``hf-darts`` never returns answers of another correction or corrects other weights.

lm-eval's ``--use_cache`` keys each answer by its request alone; a run with one correction must
not read the answers a run with another correction cached. ``peft=`` and ``delta=`` change the
merged weights, which the surgery was calibrated on without them: refused, before the model loads.
Runs through the stock ``lm_eval`` console script on the tiny model of ``test_hf_darts``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from sqlitedict import SqliteDict
from test_hf_darts import (  # noqa: F401  (merged, evaluate: fixtures)
    BIN,
    MC,
    TASKS_DIR,
    assert_same_up_to_float_noise,
    cli_samples,
    evaluate,
    merged,
)
from transformers import AutoModelForCausalLM

from lm_eval_darts.model import DartsHFLM
from mergekit_darts.errors import ModelArgsError

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
