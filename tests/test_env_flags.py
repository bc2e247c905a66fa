"""Boolean environment variables: one parser for DARTS_NO_HOOK and DARTS_OVERWRITE_SURGERY.

`DARTS_OVERWRITE_SURGERY=false` must not replace a folder and `DARTS_NO_HOOK=0` must not switch the
hook off; anything but 1/true/yes/on, 0/false/no/off (any case) or empty is refused in one line.
The startup tests run this checkout's `startup/` files in an interpreter started with `-S`, whose
site directories are added by hand (the venv's own copy is the one `make install` put there).
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tiny import merge, merge_config

from mergekit_darts.envflags import EnvFlagError, env_flag

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, False),
        ("", False),
        ("  ", False),
        ("1", True),
        ("true", True),
        ("Yes", True),
        (" ON ", True),
        ("0", False),
        ("false", False),
        ("NO", False),
        ("off", False),
    ],
)
def test_booleans(value, expected):
    environ = {} if value is None else {"FLAG": value}
    assert env_flag("FLAG", environ=environ) is expected
    if not (value or "").strip():
        assert env_flag("FLAG", True, environ=environ) is True  # empty: the default


@pytest.mark.parametrize("value", ["2", "maybe", "y", "none", "truee"])
def test_anything_else_is_one_line(value):
    with pytest.raises(EnvFlagError) as info:
        env_flag("FLAG", environ={"FLAG": value})
    assert str(info.value) == (
        f"FLAG={value!r} is not a boolean; set it to one of 1/true/yes/on or 0/false/no/off, "
        "or unset it"
    )


@pytest.mark.parametrize("value", ["false", "no", "0", "OFF"])
def test_overwrite_false_keeps_the_folder(
    tiny_family, calibration_data, tmp_path, monkeypatch, value
):
    out = tmp_path / "out"
    (out / "surgery").mkdir(parents=True)
    (out / "surgery" / "manifest.json").write_text("{}")
    monkeypatch.setenv("DARTS_OVERWRITE_SURGERY", value)
    with pytest.raises(Exception, match="already exists"):
        merge(merge_config(tiny_family, calibration_data), out)
    assert sorted(p.name for p in out.iterdir()) == ["surgery"]


@pytest.mark.parametrize(
    ("name", "value"), [("DARTS_OVERWRITE_SURGERY", "maybe"), ("DARTS_NO_HOOK", "2")]
)
def test_flag_that_is_not_a_boolean_is_refused_before_merging(
    tiny_family, calibration_data, tmp_path, monkeypatch, name, value
):
    monkeypatch.setenv(name, value)
    with pytest.raises(EnvFlagError, match=f"^{name}='{value}' is not a boolean"):
        merge(merge_config(tiny_family, calibration_data), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_stock_mergekit_yaml_with_overwrite_no(tiny_family, calibration_data, tmp_path):
    (tmp_path / "merge.yml").write_text(yaml.safe_dump(merge_config(tiny_family, calibration_data)))
    (tmp_path / "out" / "surgery").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "DARTS_NO_HOOK"}
    done = subprocess.run(
        [str(BIN / "mergekit-yaml"), "merge.yml", "out"],
        cwd=tmp_path,
        env=env | {"DARTS_OVERWRITE_SURGERY": "no"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("Error: out/surgery already exists")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["surgery"]


# ---- the startup hook, from this checkout's startup/ ---------------------------------------------

STARTUP = """
import site, sys
site.addsitedir({startup!r})
if {venv}:
    site.addsitedir({site_packages!r})
print(sum(type(f).__name__ == "_DartsFinder" for f in sys.meta_path))
{then}
"""


def startup(tmp_path: Path, value: str | None, *, venv: bool = False, then: str = ""):
    """A Python start with this checkout's .pth; prints how many hook finders are installed."""
    folder = tmp_path / "startup"
    if not folder.exists():
        shutil.copytree(REPO / "startup", folder)
    script = STARTUP.format(
        startup=str(folder), venv=venv, site_packages=site.getsitepackages()[0], then=then
    )
    env = {k: v for k, v in os.environ.items() if k != "DARTS_NO_HOOK"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if value is not None:
        env["DARTS_NO_HOOK"] = value
    return subprocess.run(
        [sys.executable, "-S", "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("value", "hooked"),
    [(None, 1), ("", 1), ("0", 1), ("false", 1), ("Off", 1), ("no", 1), ("1", 0), ("TRUE", 0)],
)
def test_startup_hook_reads_the_flag_as_a_boolean(tmp_path, value, hooked):
    done = startup(tmp_path, value)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(hooked)]
    assert done.stderr == ""


@pytest.mark.slow
def test_startup_hook_reports_a_bad_flag_in_one_line_and_stays_on(tmp_path):
    done = startup(tmp_path, "maybe")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1"]
    assert done.stderr.splitlines() == [
        "mergekit-darts: DARTS_NO_HOOK='maybe' is not a boolean; set it to one of 1/true/yes/on or "
        "0/false/no/off, or unset it (the startup hook stays on)"
    ]


MERGEKIT_YAML = """
from mergekit.scripts.run_yaml import main
sys.argv = ["mergekit-yaml", "merge.yml", "out"]
main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("value", ["0", "false", "maybe"])
def test_stock_mergekit_yaml_is_hooked_unless_the_flag_is_true(
    tiny_family, calibration_data, tmp_path, value
):
    """A block that must be refused proves the hook ran: unhooked mergekit would merge it."""
    config = merge_config(tiny_family, calibration_data)
    config["surgery"]["tasks"][0]["calibration"]["max_length"] = 600
    (tmp_path / "merge.yml").write_text(yaml.safe_dump(config))
    done = startup(tmp_path, value, venv=True, then=MERGEKIT_YAML)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    if value == "maybe":
        assert last.startswith("Error: DARTS_NO_HOOK='maybe' is not a boolean")
    else:
        assert last.startswith("Error: surgery.tasks[0].calibration.max_length: 600 exceeds")
    assert not (tmp_path / "out").exists()
