"""The demo's reproducibility pins reach torch in the driver and every subprocess it starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from demo import pinning, run
from demo.pinning import PINS, pinned_env, unpinned

HOSTILE = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "AUTO",
    "OMP_NUM_THREADS": "2",
    "ONEDNN_MAX_CPU_ISA": "ALL",
}


def test_pinned_env_overrides_whatever_the_user_set() -> None:
    env = pinned_env({**HOSTILE, "HOME": "/somewhere"})
    assert {k: env[k] for k in PINS} == PINS
    assert env["HOME"] == "/somewhere"
    assert unpinned(env) == {}
    assert unpinned(HOSTILE)["ATEN_CPU_CAPABILITY"] == "default"


def test_merge_subprocess_gets_the_pins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in HOSTILE.items():
        monkeypatch.setenv(key, value)
    seen: dict[str, str] = {}

    def fake_run(command: list[str], check: bool, env: dict[str, str]) -> None:
        seen.update(env)

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    config = tmp_path / "m.yml"
    config.write_text("merge_method: linear\n")
    run.run_mergekit_yaml(config, tmp_path / "out", seed=0, fresh=True)
    assert {k: seen[k] for k in PINS} == PINS


def test_a_merge_is_redone_for_a_rebuilt_family(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[list[str]] = []

    def fake_run(command: list[str], check: bool, env: dict[str, str]) -> None:
        runs.append(command)
        Path(command[2]).mkdir(parents=True, exist_ok=True)

    monkeypatch.setattr(run.subprocess, "run", fake_run)
    config = tmp_path / "m.yml"
    config.write_text("merge_method: linear\n")
    for family_key in ("family A", "family A", "family B"):
        run.run_mergekit_yaml(config, tmp_path / "out", 0, False, family_key)
    assert len(runs) == 2  # the same family is a cache hit; another one is merged again


def test_reexec_replaces_an_unpinned_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in HOSTILE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(pinning.REEXEC_MARK, raising=False)
    monkeypatch.delitem(sys.modules, "torch")  # as at the top of `python -m demo`
    calls = []
    monkeypatch.setattr(pinning.os, "execve", lambda *args: calls.append(args))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    pinning.reexec_if_unpinned("demo", ["--scale", "tiny"])
    (exe, argv, env) = calls[0]
    assert argv == [sys.executable, "-m", "demo", "--scale", "tiny"]
    assert {k: env[k] for k in PINS} == PINS
    # the checkout holding demo/ first, then what the caller had
    checkout = str(Path(__file__).resolve().parents[1])
    assert env["PYTHONPATH"].split(os.pathsep) == [checkout, "/elsewhere"]


def test_python_m_demo_reexecs_and_runs_from_another_directory(tmp_path: Path) -> None:
    """The real command, unpinned, started outside the checkout: the process it re-executes
    into (the hostile shell always triggers one) imports `demo` and prints the help."""
    checkout = Path(__file__).resolve().parents[1]
    env = {**os.environ, **HOSTILE, "PYTHONPATH": str(checkout)}
    env.pop(pinning.REEXEC_MARK, None)
    done = subprocess.run(
        [sys.executable, "-m", "demo", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "Usage: python -m demo" in done.stdout


def test_reexec_refuses_once_torch_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch  # noqa: F401

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    with pytest.raises(RuntimeError, match="before torch"):
        pinning.reexec_if_unpinned("demo", [])


def _has_avx2() -> bool:
    try:
        return " avx2 " in f" {Path('/proc/cpuinfo').read_text().replace(chr(10), ' ')} "
    except OSError:
        return False


@pytest.mark.skipif(not _has_avx2(), reason="needs an x86-64 CPU with AVX2")
def test_a_real_reexec_starts_torch_with_the_avx2_kernels_and_mkl_compatible(
    tmp_path: Path,
) -> None:
    """End to end: a hostile environment, the re-exec, and what torch then reports."""
    probe = tmp_path / "darts_pin_probe.py"
    probe.write_text(
        textwrap.dedent(
            """
            import os, sys
            from demo.pinning import PINS, apply_in_process, reexec_if_unpinned
            if __name__ == "__main__":
                reexec_if_unpinned("darts_pin_probe", sys.argv[1:])
                info = apply_in_process()
                print(info["torch_cpu_capability"], info["mkl_branch"], info["torch_threads"],
                      info["pinned_before_torch"])
            """
        )
    )
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, **HOSTILE, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(repo)])}
    env.pop(pinning.REEXEC_MARK, None)
    out = subprocess.run(
        [sys.executable, "-m", "darts_pin_probe"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    # MKL's own report: an instruction-set branch (MKL_CBWR=AVX2) is not applied on AMD CPUs
    assert out.stdout.split() == ["AVX2", "COMPATIBLE", "1", "True"]


def test_the_environment_check_covers_the_issue_settings_and_an_empty_shell(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from benchmarks.demo_envs import ENVS, environment

    monkeypatch.setenv("MKL_CBWR", "AUTO")
    assert unpinned(environment("pinned")) == {}  # no re-exec: the pins are already there
    assert environment("portable")["ATEN_CPU_CAPABILITY"] == "default"
    assert environment("avx512")["MKL_CBWR"] == "AUTO"
    assert unpinned(environment("avx512"))["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"
    assert set(environment("empty")) == {"PATH"}
    assert set(ENVS) == {"pinned", "portable", "avx512", "empty"}
