"""A surgery model argument that cannot be used ends ``lm_eval`` with one line.

``surgery=maths`` (a typo in the value) or ``surgerypath=`` (a typo in the name) must not end in
a Python traceback from inside ``hf-darts`` or the model class. The stock ``lm_eval`` (through
the startup hook) and the ``lm-eval-darts`` fallback (hook off) print ``Error: <message>`` and
exit with status 1, like every mergekit-darts command. Both run as real console scripts, started
together (each spends ~15 s indexing tasks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny

BIN = Path(sys.executable).parent
TASKS_DIR = Path(__file__).parent / "lm_eval_tasks"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("surgery_args", "expected"),
    [
        ("surgery=maths", "Error: no surgery task 'maths' in {surgery}; available: math, code"),
        (  # refused before the weights load, not a TypeError from the model class after it
            "surgery=math,surgerypath={surgery}",
            "Error: hf-darts: unknown model argument surgerypath=; did you mean surgery_path=? "
            "(hf-darts reads surgery=, surgery_path= and surgery_map=; other arguments go to "
            "lm-eval's hf model)",
        ),
    ],
    ids=["unknown-task", "misspelled-argument"],
)
def test_an_unusable_surgery_argument_is_one_line(merged_copy, surgery_args, expected):
    merged = merged_copy
    tiny.write_surgery(
        merged / "surgery", tiny.random_modules({"math": "pos_corr", "code": "pos_corr"}, 64, 4, 8)
    )
    model_args = f"pretrained={merged}," + surgery_args.format(surgery=merged / "surgery")
    args = [
        "--model", "hf-darts", "--model_args", model_args,
        "--tasks", "darts_tiny_mc", "--include_path", ".", "--device", "cpu", "--limit", "1",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "DARTS_NO_HOOK"} | {"OMP_NUM_THREADS": "1"}
    runs = {"lm_eval": env, "lm-eval-darts": env | {"DARTS_NO_HOOK": "1"}}
    procs = {
        script: subprocess.Popen(
            [str(BIN / script), *args],
            cwd=TASKS_DIR,
            env=script_env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for script, script_env in runs.items()
    }
    try:
        errors = {script: proc.communicate(timeout=300)[1] for script, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()  # only matters after a timeout
    expected = expected.format(surgery=merged / "surgery")
    for script, proc in procs.items():
        assert proc.returncode == 1, (script, errors[script][-3000:])
        assert "Traceback" not in errors[script], (script, errors[script][-3000:])
        assert errors[script].rstrip("\n").splitlines()[-1] == expected, script
