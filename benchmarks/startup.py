"""Import-time cost of the ``.pth`` startup hook on the commands users type.

Each command runs many times, alternating hook on / ``DARTS_NO_HOOK=1`` (ABBA order), under
``python -X importtime``. Three numbers come out: the median paired difference in wall time and
in CPU time (what the user feels, but on a loaded 2-core machine the noise of a multi-second
command is far above 20 ms), and the import time attributed to the hook: the summed self time
of every module that is imported only when the hook is on, plus the meta-path finder's cost on
every other import. The attributed number is precise to a millisecond and is what the target is
judged on; the wall-clock difference is reported next to it with its spread.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.calibration import ratio

TARGET_MS = 20.0


def parse_importtime(stderr: str) -> dict[str, int]:
    """``-X importtime`` lines -> {module: self time in microseconds}."""
    found: dict[str, int] = {}
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        parts = line[len("import time:") :].split("|")
        if len(parts) != 3:
            continue
        try:
            found[parts[2].strip()] = int(parts[0])
        except ValueError:
            continue  # the header line
    return found


def _command(argv: list[str]) -> list[str]:
    """``python -X importtime`` + the script behind a console-script name (or an interpreter)."""
    first = argv[0]
    if Path(first).name.startswith("python"):
        return [first, "-X", "importtime", *argv[1:]]
    script = shutil.which(first, path=str(Path(sys.executable).parent)) or shutil.which(first)
    if script is None:
        raise FileNotFoundError(f"{first} is not installed next to {sys.executable}")
    return [sys.executable, "-X", "importtime", script, *argv[1:]]


def _run_once(cmd: list[str], hook: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if hook:
        env.pop("DARTS_NO_HOOK", None)
    else:
        env["DARTS_NO_HOOK"] = "1"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "wall": wall,
        "cpu": cpu,
        "rc": proc.returncode,
        "imports": parse_importtime(proc.stderr),
        "error": proc.stderr.strip().splitlines()[-1] if proc.returncode else None,
    }


def finder_call_seconds(calls: int = 20000) -> float:
    """Cost of one ``find_spec`` call of the hook's finder for a module it does not watch."""
    try:
        import _darts_startup
    except ImportError:
        return 0.0
    finder = _darts_startup._DartsFinder()
    started = time.perf_counter()
    for _ in range(calls):
        finder.find_spec("some.unwatched.module")
    return (time.perf_counter() - started) / calls


def measure_command(argv: list[str], repeats: int) -> dict[str, Any]:
    """Alternate hook on/off ``repeats`` times; paired differences and the attributed cost."""
    cmd = _command(argv)
    per_call = finder_call_seconds()
    rounds = []
    for i in range(repeats):
        order = (True, False) if i % 2 == 0 else (False, True)
        runs = {hook: _run_once(cmd, hook) for hook in order}
        on, off = runs[True], runs[False]
        extra = set(on["imports"]) - set(off["imports"])
        attributed = sum(on["imports"][m] for m in extra) / 1e6 + per_call * len(on["imports"])
        rounds.append(
            {
                "on": on,
                "off": off,
                "wall_diff": on["wall"] - off["wall"],
                "cpu_diff": on["cpu"] - off["cpu"],
                "attributed": attributed,
                "extra": sorted(((on["imports"][m], m) for m in extra), reverse=True),
            }
        )
    last = rounds[-1]
    walls = [r["wall_diff"] for r in rounds]
    return {
        "command": " ".join(argv),
        "repeats": repeats,
        "with_hook_s": statistics.median(r["on"]["wall"] for r in rounds),
        "without_hook_s": statistics.median(r["off"]["wall"] for r in rounds),
        "wall_diff_ms": statistics.median(walls) * 1e3,
        "wall_diff_spread_ms": (max(walls) - min(walls)) * 1e3,
        "cpu_diff_ms": statistics.median(r["cpu_diff"] for r in rounds) * 1e3,
        "attributed_ms": statistics.median(r["attributed"] for r in rounds) * 1e3,
        "finder_ms": per_call * len(last["on"]["imports"]) * 1e3,
        "hook_only_modules": len(last["extra"]),
        "top_hook_only_imports_ms": [[m, us / 1e3] for us, m in last["extra"][:8]],
        "exit_codes": sorted({r[k]["rc"] for r in rounds for k in ("on", "off")}),
        "errors": sorted({r[k]["error"] for r in rounds for k in ("on", "off") if r[k]["error"]}),
    }


def run(settings: Any, tick: Callable[[str], None]) -> dict[str, Any]:
    commands: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    for label, (argv, repeats) in settings.startup.items():
        tick(f"startup: {label} x{repeats} pairs")
        found = measure_command(list(argv), repeats)
        commands[label] = found
        ratios[f"startup hook cost, ms ({label})"] = ratio(found["attributed_ms"], TARGET_MS)
        ratios[f"with hook / without, wall time ({label})"] = ratio(
            found["with_hook_s"] / found["without_hook_s"], None
        )
    return {"commands": commands, "ratios": ratios}
