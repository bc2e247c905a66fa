"""What a surgery run leaves in the merged folder, by name: every file name lives here.

``<merged>/surgery/`` holds one safetensors file per task, ``manifest.json`` (settings, prompt
hashes, metrics, timings), the block as run (``surgery.yml``), per-task diagnostics and, once
``mergekit-darts report`` ran, the report. The YAML key of the block is ``surgery`` too.
"""

from __future__ import annotations

from pathlib import Path

BLOCK_KEY = "surgery"  # the merge YAML's key for the block
SURGERY_DIR = "surgery"  # the folder inside a merged model
MANIFEST = "manifest.json"
SURGERY_YAML = "surgery.yml"  # the block as it was run
REPORT_DIR = "report"  # inside surgery/: replaced together with the modules it describes
RECIPE = "mergekit_config.yml"  # mergekit's record of the merge
FORMAT = "darts-surgery"
VERSION = 1


def surgery_dir(merged: str | Path) -> Path:
    """``<merged>/surgery``."""
    return Path(merged) / SURGERY_DIR


def module_file(task: str) -> str:
    """The task's module, relative to ``surgery/``."""
    return f"{task}.safetensors"


def diagnostics_file(task: str) -> str:
    """The task's diagnostics (Figure 1's data), relative to ``surgery/``."""
    return f"diagnostics/{task}.safetensors"
