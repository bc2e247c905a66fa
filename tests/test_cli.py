"""``mergekit-darts``: help without the heavy libraries, mergekit's flags on ``merge``, one-line errors.

Help is checked in a fresh interpreter, since this one has torch loaded already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mergekit_darts.cli import COMMANDS, load, main
from mergekit_darts.errors import SurgeryConfigError

HEAVY = ("torch", "transformers", "matplotlib", "scipy", "lm_eval", "mergekit")
HELP_NAMES = {  # what each help must show
    "": [*COMMANDS, "--version"],
    "merge": ["CONFIG_FILE OUT_PATH", "--overwrite-surgery", "`mergekit-yaml --help`"],
    "calibrate": [
        "OUT_PATH SURGERY_YML",
        "--overwrite",
        "--quiet",
        "--write-model-card",
        "--cache-dir",
    ],
    "export": ["OUT_PATH DEST", "--task", "--all", "--link [symlink|hardlink|copy]"],
    "report": ["MERGED", "--output", "--recompute", "--quiet"],
    "sweep": ["SPEC_PATH", "--output", "--cache-dir"],
    "stats": ["RESULTS_DIR", "--a", "--b", "--unit [seed|item]"],
}
PROBE = """
import json, sys
from mergekit_darts.cli import main
main(sys.argv[1:], standalone_mode=False)
modules = [name.partition(".")[0] for name in sys.modules]
print(json.dumps({"heavy": sorted(set(modules) & set(%r)),
                  "commands": sorted(n for n in sys.modules if n.startswith("mergekit_darts.cli."))}),
      file=sys.stderr)
"""


def run_help(*args: str) -> tuple[str, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE % (HEAVY,), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return done.stdout, json.loads(done.stderr.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("command", list(HELP_NAMES))
def test_help_imports_no_heavy_library(command: str) -> None:
    text, seen = run_help(*command.split(), "--help")
    assert seen["heavy"] == [], seen
    assert seen["commands"] == ([f"mergekit_darts.cli.{command}"] if command else [])
    for name in HELP_NAMES[command]:
        assert name in text, (name, text)


@pytest.mark.slow
def test_merge_help_with_mergekit_flags_still_needs_no_mergekit() -> None:
    text, seen = run_help("merge", "--cuda", "--out-shard-size", "1B", "x.yml", "--help")
    assert seen["heavy"] == [] and "--overwrite-surgery" in text


def test_command_list_matches_each_command_help() -> None:
    """The table's summary is the first sentence of the command's own help, so they agree."""
    for name, entry in COMMANDS.items():
        command = load(entry)
        assert command.name == name
        assert command.get_short_help_str(limit=1000) == entry.summary


# ---- merge: mergekit's own options, parsed when the command runs --------------------------------------


@pytest.fixture
def merged_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``merge_with_surgery`` and mergekit's global settings, recorded instead of run."""
    from mergekit.options import MergeOptions

    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(
        MergeOptions, "apply_global_options", lambda self: calls.append({"global": self})
    )

    def merge_with_surgery(run_merge, config, out_path, options, source, *, overwrite):
        calls.append({"out": out_path, "options": options, "overwrite": overwrite, "src": source})

    monkeypatch.setattr("mergekit_darts.hosts.mergekit.hook.merge_with_surgery", merge_with_surgery)
    return calls


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "merge.yml"
    path.write_text("merge_method: linear\nmodels:\n  - model: a\n    parameters: {weight: 1}\n")
    return path


def test_merge_accepts_mergekit_flags_anywhere(merged_calls, config: Path, tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    args = ["merge", "--lazy-unpickle", str(config), "-vv", out, "--out-shard-size", "1B"]
    args += ["--random-seed", "3", "--allow-crimes", "--no-copy-tokenizer", "--overwrite-surgery"]
    run = CliRunner().invoke(main, args)
    assert run.exit_code == 0, run.output
    applied, merged = merged_calls
    options = merged["options"]
    assert applied["global"] is options
    assert (merged["out"], merged["overwrite"], merged["src"]) == (out, True, config.read_text())
    assert options.lazy_unpickle and options.allow_crimes and not options.copy_tokenizer
    assert (options.out_shard_size, options.random_seed, options.verbosity) == (10**9, 3, 2)


def test_merge_defaults_are_mergekit_yamls(merged_calls, config: Path, tmp_path: Path) -> None:
    from mergekit.options import MergeOptions
    from mergekit.scripts.run_yaml import main as mergekit_yaml

    from mergekit_darts.cli.merge import with_mergekit_options

    run = CliRunner().invoke(main, ["merge", str(config), str(tmp_path / "out")])
    assert run.exit_code == 0, run.output
    assert merged_calls[1]["options"] == MergeOptions() and merged_calls[1]["overwrite"] is False
    ours = {param.name: param.opts for param in with_mergekit_options().params}
    assert all(ours.get(param.name) == param.opts for param in mergekit_yaml.params)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no-such-flag"], "No such option '--no-such-flag'"),
        (["--out-shard-size"], "Option '--out-shard-size' requires an argument."),
        ([], "Missing argument 'OUT_PATH'."),
    ],
)
def test_merge_usage_errors_are_clicks(merged_calls, config: Path, args, message) -> None:
    run = CliRunner().invoke(main, ["merge", str(config), *args])
    assert run.exit_code == 2 and message in run.output and not merged_calls, run.output


# ---- errors ------------------------------------------------------------------------------------------


def test_darts_error_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise SurgeryConfigError("surgery.steps: must be positive; set steps: 100")

    monkeypatch.setattr("mergekit_darts.hosts.post_merge.run_surgery", refuse)
    (tmp_path / "surgery.yml").write_text("steps: 0\n")
    run = CliRunner().invoke(main, ["calibrate", str(tmp_path), str(tmp_path / "surgery.yml")])
    assert run.exit_code == 1
    assert run.output == "Error: surgery.steps: must be positive; set steps: 100\n"


def test_a_mistyped_command_gets_a_suggestion() -> None:
    run = CliRunner().invoke(main, ["merg"])
    assert run.exit_code == 2 and "No such command 'merg'. Did you mean 'merge'?" in run.output
