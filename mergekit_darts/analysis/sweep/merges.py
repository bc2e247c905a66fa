"""The merged models of a sweep: the one given (``merged:``) or a merge grid (``merges:``).

A merge grid (the paper's section 4.1 protocol) merges each YAML with mergekit's own
``run_merge`` into ``<output>/merges/<yaml stem>/`` and runs the whole surgery grid on every
merge. Every YAML is read and validated before anything is merged; a merge is kept across runs
while its YAML is unchanged, and a killed merge is redone, never used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mergekit_darts.analysis.sweep.spec import SweepSpec
from mergekit_darts.config import read_yaml
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.folder import fs
from mergekit_darts.folder.identity import two_merges

MERGES = "merges"  # <output>/merges/<yaml stem>/
MERGE_MARKER = ".darts-sweep-merge"  # sha256 of the merge YAML the folder was made from


@dataclass(frozen=True)
class Merge:
    """One merged model of the sweep: given (``merged:``) or made from a YAML (``merges:``)."""

    name: str | None  # the YAML's stem; None for ``merged:``
    folder: Path
    source: Path | None = None  # the merge YAML
    config: Any = None  # its MergeConfiguration
    text: str = ""

    @property
    def fingerprint(self) -> tuple[str, ...]:
        """A changed merge YAML reruns the merge's cells (its folder keeps its name)."""
        return (hashlib.sha256(self.text.encode()).hexdigest(),) if self.source else ()


def locate_merges(spec: SweepSpec, output: Path) -> list[Merge]:
    """The merges to run, every YAML read and validated before anything is merged."""
    if spec.merged is not None:
        merged = Path(spec.merged).expanduser().resolve()
        if not (merged / "config.json").is_file():
            raise SurgeryConfigError(f"sweep.merged: no model (config.json) in {merged}")
        problem = two_merges(merged)
        if problem is not None:
            raise SurgeryConfigError(f"sweep.merged: {problem}")
        if fs.inside(output, merged):
            raise SurgeryConfigError(
                f"sweep.output: {output} is inside the merged model folder {merged}, which a "
                "sweep never writes (its cells and results go to the output folder): choose an "
                "output folder outside it"
            )
        return [Merge(None, merged)]
    from mergekit.config import MergeConfiguration

    paths, seen = [], {}
    for index, entry in enumerate(spec.merges or []):
        key, path = f"sweep.merges[{index}]", Path(entry).expanduser()
        if path.stem in seen:
            raise SurgeryConfigError(
                f"{key}: {entry} and {seen[path.stem]} share the name {path.stem!r}, and each "
                f"merge is written to <output>/merges/<name>/; rename one"
            )
        seen[path.stem] = entry
        if not path.is_file():
            raise SurgeryConfigError(f"{key}: no merge YAML at {path.resolve()}")
        paths.append((key, entry, path))
    merges = []
    for key, entry, path in paths:
        text = path.read_text(encoding="utf-8")
        try:
            config = MergeConfiguration.model_validate(read_yaml(path))
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(map(str, first["loc"]))
            raise SurgeryConfigError(
                f"{key}: {entry} is not a mergekit config ({where}: {first['msg'].lower()})"
            ) from None
        except (RuntimeError, ValueError, TypeError) as err:  # mergekit's own validators
            raise SurgeryConfigError(
                f"{key}: {entry} is not a mergekit config ({' '.join(str(err).split())})"
            ) from None
        folder = (output / MERGES / path.stem).resolve()
        merges.append(Merge(path.stem, folder, path.resolve(), config, text))
    return merges


def make_merge(merge: Merge, log: Callable[[str], None] = print) -> Path:
    """Merge with mergekit's own (unwrapped) ``run_merge``, unless done from this very YAML.

    The YAML's own ``surgery:`` block is not run: every merge gets the sweep's grid. The merge
    is written into a staging folder swapped in whole (``fs.staged_folder``), so a killed merge
    is redone, never used.
    """
    import inspect

    from mergekit import merge as mergekit_merge
    from mergekit.options import MergeOptions

    marker = merge.folder / MERGE_MARKER
    if marker.is_file() and marker.read_text() == merge.fingerprint[0]:
        log(f"merge {merge.name}: done earlier, kept")
        return merge.folder
    log(f"merge {merge.name}: merging {merge.source}")
    stock = inspect.unwrap(mergekit_merge.run_merge)
    with fs.staged_folder(merge.folder) as staging:
        stock(merge.config, str(staging), MergeOptions(quiet=True), config_source=merge.text)
        (staging / MERGE_MARKER).write_text(merge.fingerprint[0])
    return merge.folder
