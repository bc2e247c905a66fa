"""Keep the merge recipe in an output folder in step with the surgery that was last run there.

mergekit copies the merge YAML, ``surgery:`` block included, into ``mergekit_config.yml`` and into
its model card. ``mergekit-darts calibrate`` with another block then left two different blocks in
one folder. After every run, a recipe whose block differs from the one just run gets that block
instead (``surgery/surgery.yml`` holds the same); the merge part stays byte for byte as mergekit
wrote it, so re-running the file gives the folder as it now is. A recipe without a block (a merge
calibrated afterwards) is left alone: it never claimed a surgery.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from mergekit_darts.folder.fs import write_text
from mergekit_darts.folder.manifest import BLOCK_KEY, RECIPE


def record_block(folder: str | Path, block: Mapping[str, Any], *, card: bool = True) -> bool:
    """Put ``block`` into ``folder``'s recipe (and, with ``card``, the card's copy of it).

    Returns whether anything changed.
    """
    recipe = Path(folder) / RECIPE
    if not recipe.is_file():
        return False
    text = recipe.read_text(encoding="utf-8")
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    block = json.loads(json.dumps(dict(block)))  # plain data, as YAML reads it back
    if not isinstance(config, Mapping) or BLOCK_KEY not in config or config[BLOCK_KEY] == block:
        return False
    wanted = {**config, BLOCK_KEY: block}
    updated = _replace_block(text, block)
    if updated is None or yaml.safe_load(updated) != wanted:
        updated = yaml.safe_dump(wanted, sort_keys=False)  # unusual layout: the same data, redrawn
    write_text(recipe, updated)
    readme = recipe.with_name("README.md")
    if card and readme.is_file():
        shown = readme.read_text(encoding="utf-8")
        if shown.count(text) == 1:  # mergekit's card quotes the recipe verbatim
            write_text(readme, shown.replace(text, updated))
    return True


def _replace_block(text: str, block: Mapping[str, Any]) -> str | None:
    """``text`` with its top-level ``surgery:`` entry swapped for ``block``; None if not found."""
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.split(":", 1)[0] == BLOCK_KEY]
    if len(starts) != 1:
        return None
    start = end = starts[0]
    end += 1
    while end < len(lines) and (lines[end][:1] in (" ", "\t", "#") or not lines[end].strip()):
        end += 1
    while end > start + 1 and (not lines[end - 1].strip() or lines[end - 1].startswith("#")):
        end -= 1  # blank lines and comments between the block and the next key stay put
    dumped = yaml.safe_dump({BLOCK_KEY: block}, sort_keys=False)
    return "".join(lines[:start]) + dumped + "".join(lines[end:])
