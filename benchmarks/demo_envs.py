"""`make demo-envs`: `make demo` under four shell environments; `table.md` must be byte-identical.

The demo pins the variables that decide float rounding and re-executes itself with them
(demo/pinning.py); this check runs the real command, from scratch, under:

- ``pinned``: the caller's environment with the pins already set (no re-exec);
- ``portable``: ``ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=2``;
- ``avx512``: torch's and oneDNN's AVX-512 kernels, MKL's automatic dispatch, two threads;
- ``empty``: ``env -i`` with only ``PATH`` (make exports the offline flags).

Each writes its own out folder (family, merges, evaluations) under ``--out``; ``--jobs``
run at once (each is single-threaded once pinned). Results: a markdown table on stdout and
``demo-envs.json`` under ``--out``; exit status 1 when the tables differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from demo.pinning import PINS

ENVS: dict[str, dict[str, str]] = {
    "pinned": dict(PINS),
    "portable": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_CBWR": "COMPATIBLE",
        "OMP_NUM_THREADS": "2",
    },
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_CBWR": "AUTO",
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2",
    },
    "empty": {},
}
REPO = Path(__file__).resolve().parents[1]


def environment(name: str) -> dict[str, str]:
    """The shell environment `make demo` starts in for one setting."""
    if name == "empty":
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    return {**os.environ, **ENVS[name]}


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def run_one(name: str, out: Path, demo_args: list[str]) -> dict[str, Any]:
    """`make demo` with its own out folder under one environment; hashes of what it wrote."""
    folder = out / name
    args = shlex.join(["--out", str(folder), *demo_args])
    log = out / f"{name}.log"
    start = time.perf_counter()
    with log.open("w") as stream:
        rc = subprocess.run(
            ["make", "-s", "demo", f"DEMO_ARGS={args}"],
            cwd=REPO,
            env=environment(name),
            stdout=stream,
            stderr=subprocess.STDOUT,
        ).returncode
    results = folder / "results.json"
    pins = json.loads(results.read_text())["settings"]["pins"] if results.is_file() else {}
    return {
        "env": ENVS[name],
        "returncode": rc,
        "seconds": round(time.perf_counter() - start, 1),
        "table_sha256": sha256(folder / "table.md"),
        "base_sha256": sha256(folder / "family" / "base" / "model.safetensors"),
        "runtime": {k: v for k, v in pins.items() if k != "env"},
        "log": str(log),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo_envs", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("runs/demo-envs"))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", action="append", choices=list(ENVS), help="Repeatable.")
    parser.add_argument("demo_args", nargs="*", help="After --: passed to the demo.")
    opts = parser.parse_args(argv)
    out = opts.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = opts.only or list(ENVS)
    with ThreadPoolExecutor(opts.jobs) as pool:
        runs = dict(
            zip(names, pool.map(lambda n: run_one(n, out, opts.demo_args), names), strict=True)
        )
    tables = {r["table_sha256"] for r in runs.values()}
    same = len(tables) == 1 and None not in tables
    (out / "demo-envs.json").write_text(
        json.dumps({"demo_args": opts.demo_args, "identical": same, "runs": runs}, indent=2) + "\n"
    )
    print("| environment | exit | seconds | table.md sha256 | base weights sha256 | MKL branch |")
    print("|---|---|---|---|---|---|")
    for name, r in runs.items():
        cells = [name, r["returncode"], r["seconds"], r["table_sha256"], r["base_sha256"]]
        print("| " + " | ".join(map(str, [*cells, r["runtime"].get("mkl_branch")])) + " |")
    print("identical tables" if same else "TABLES DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
