"""The wheel holds the product alone: the two packages and the startup hook, no demo, benchmarks
or tests (those live beside it in the repository)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# hatchling's PEP 517 hook, run from the project root as pip runs it
BUILD = "import sys, hatchling.build; print(hatchling.build.build_wheel(sys.argv[1]))"


@pytest.mark.slow
def test_the_wheel_ships_only_the_product(tmp_path: Path) -> None:
    pytest.importorskip("hatchling", reason="needs the build backend: pip install hatchling")
    done = subprocess.run(
        [sys.executable, "-c", BUILD, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    names = zipfile.ZipFile(tmp_path / done.stdout.split()[-1]).namelist()
    top = {name.split("/")[0] for name in names}
    info = {t for t in top if t.endswith(".dist-info")}
    assert len(info) == 1, info
    assert top - info == {
        "mergekit_darts",
        "lm_eval_darts",
        "mergekit_darts_hook.pth",
        "_darts_startup.py",
    }
    assert not [n for n in names if "demo" in Path(n).parts], "the demo ships in the wheel"
    assert "mergekit_darts/correction/modeling_darts.py" in names  # the product is all there
    assert "lm_eval_darts/model.py" in names
