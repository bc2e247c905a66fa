"""Make mergekit's own ``run_merge`` honour a ``surgery:`` block.

The ``.pth`` startup hook calls :func:`install` right after ``mergekit.merge`` is imported and
before ``mergekit-yaml`` from-imports ``run_merge``. The wrapper reads the raw YAML mergekit
passes as ``config_source`` (mergekit's own config model drops unknown keys): without a block it
calls the stock function untouched; with one it validates the whole block first, merges, then
runs the surgery on the output folder. Every merge first gets the GPT-NeoX fix of
:mod:`mergekit_darts.hosts.mergekit.upstream` (docs/known-issues.md).
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from mergekit_darts.envflags import NO_HOOK, env_flag
from mergekit_darts.envflags import OVERWRITE_SURGERY as OVERWRITE_ENV

if TYPE_CHECKING:
    from mergekit_darts.calibrate.pipeline import PreparedSurgery


def install(merge_module: ModuleType) -> None:
    """Wrap ``merge_module.run_merge`` (once); the original stays reachable as ``__wrapped__``."""
    original = merge_module.run_merge
    if getattr(original, "__darts_hook__", False):
        return

    @functools.wraps(original)
    def run_merge(
        merge_config: Any, out_path: str, options: Any, config_source: str | None = None
    ) -> Any:
        from mergekit_darts.hosts.click_errors import one_line_errors

        with one_line_errors():
            return merge_with_surgery(original, merge_config, out_path, options, config_source)

    run_merge.__darts_hook__ = True  # type: ignore[attr-defined]
    merge_module.run_merge = run_merge


def merge_with_surgery(
    run_merge: Callable[..., Any],
    merge_config: Any,
    out_path: str,
    options: Any,
    config_source: str | None = None,
    *,
    overwrite: bool | None = None,
) -> Any:
    """``run_merge`` plus, when ``config_source`` has a ``surgery:`` block, the surgery.

    The block, its files and its targets are checked against the merge's base model before
    ``run_merge`` starts. ``overwrite=None`` reads ``DARTS_OVERWRITE_SURGERY``. An existing
    ``surgery/`` (allowed by the overwrite flag, or the merge has no block) is set aside before
    the merge (:func:`set_aside`) and put back if the merge reproduced its weights. Weight files
    of an earlier merge that this one left beside its own (another shard layout) stop the
    surgery before it starts, and keep an old ``surgery/`` aside.
    """
    # imported here, not at the top: install() runs on every `mergekit-yaml --help`
    from mergekit_darts.config import surgery_block
    from mergekit_darts.errors import DartsError, SurgeryConfigError
    from mergekit_darts.folder.identity import two_merges, weight_file_stats
    from mergekit_darts.hosts.mergekit.upstream import neox_buffers_optional

    env_flag(NO_HOOK)  # the startup hook only warned about a value that is not a boolean
    neox_buffers_optional()
    if config_source is None:
        refuse_unread_block()
    block = surgery_block(config_source)
    prepared = None
    if block is not None:
        prepared = prepare_merge_surgery(
            block, merge_config, out_path, options, overwrite=overwrite
        )
    before = weight_file_stats(out_path)
    aside = set_aside(out_path)
    result = run_merge(merge_config, out_path, options=options, config_source=config_source)
    stale = two_merges(out_path, before)  # nothing is put back onto, or fitted to, such a folder
    if aside is not None and stale is None and put_back(aside, out_path):
        aside = None
    if prepared is not None:
        try:
            if stale is not None:
                raise SurgeryConfigError(stale)
            finish_merge_surgery(prepared, out_path, options)
        except DartsError as err:
            raise type(err)(_after_merge(str(err), out_path, aside)) from err
        if aside is not None:  # replaced, as the overwrite flag asked
            shutil.rmtree(aside)
    elif stale is not None:  # a plain merge is mergekit's own: told, not refused
        _report(stale)
    return result


def refuse_unread_block(argv: list[str] | None = None) -> None:
    """Stop a ``mergekit-yaml`` merge whose YAML has a ``surgery:`` block that ``run_merge`` was
    not given (no ``config_source``: a mergekit that does not pass the text), before it merges.

    ``run_merge`` gets mergekit's parsed config, which drops the block, so the text is the only
    source; without it the YAML named on ``mergekit-yaml``'s command line (``argv``, default
    ``sys.argv``) is what shows a block would be skipped. (``mergekit-multi`` passes no text by
    design: :mod:`mergekit_darts.hosts.mergekit.multimerge` reads its stages itself.)
    """
    import yaml

    from mergekit_darts.config import surgery_block
    from mergekit_darts.errors import SurgeryConfigError

    argv = sys.argv if argv is None else argv
    if not argv or Path(argv[0]).name != "mergekit-yaml":
        return
    for arg in argv[1:]:
        path = Path(arg)
        if path.suffix not in (".yml", ".yaml") or not path.is_file():
            continue
        try:
            block = surgery_block(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):  # mergekit reports those itself
            continue
        if block is not None:
            raise SurgeryConfigError(
                f"{path} has a surgery: block, but this mergekit called run_merge without the "
                "YAML text (config_source), so the block cannot be read and would be skipped; "
                f"merge without the block, then run `mergekit-darts calibrate OUT_PATH {path}`"
            )


def set_aside(out_path: str | Path) -> Path | None:
    """Move ``out_path/surgery/`` out of the way of a merge that rewrites the weights under it.

    The folder is renamed, never deleted (``surgery.set-aside-<UTC time>``, next to it), and the
    rename is reported: a surgery belongs to the weights it was calibrated on.
    """
    from mergekit_darts.folder.manifest import surgery_dir

    folder = surgery_dir(out_path)
    if not (folder.exists() or folder.is_symlink()):
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = folder.with_name(f"{folder.name}.set-aside-{stamp}")
    number = 1
    while aside.exists() or aside.is_symlink():
        number += 1
        aside = folder.with_name(f"{folder.name}.set-aside-{stamp}-{number}")
    folder.rename(aside)
    _report(
        f"{folder} was calibrated on the weights this merge replaces: moved to {aside} "
        "(nothing deleted)"
    )
    return aside


def put_back(aside: Path, out_path: str | Path) -> bool:
    """Return a set-aside ``surgery/`` to its place when the new merge has its weights."""
    from mergekit_darts.errors import DartsError
    from mergekit_darts.folder.artifacts import read_manifest
    from mergekit_darts.folder.identity import weights_identity
    from mergekit_darts.folder.manifest import surgery_dir

    try:
        recorded = read_manifest(aside).merged_identity
    except DartsError:  # no readable manifest: nothing says it belongs to these weights
        return False
    if recorded is None or recorded != weights_identity(out_path):
        return False
    aside.rename(surgery_dir(out_path))
    _report(f"{aside}: the new merge has the weights it was calibrated on; moved back to surgery/")
    return True


def _after_merge(message: str, out_path: str | Path, aside: Path | None) -> str:
    """A surgery failure's message, told after the merge: the merge was written."""
    from mergekit_darts.calibrate.runtime import UNCHANGED
    from mergekit_darts.folder.manifest import surgery_dir

    message = message.removesuffix(f"; {UNCHANGED}")
    where = surgery_dir(out_path)
    if aside is not None:
        state = f"the previous surgery/ is at {aside} (calibrated on the weights it replaced)"
    elif where.exists():
        state = f"{where} was calibrated on these same weights and is unchanged"
    else:
        state = "it has no surgery/"
    return f"{message}; the merge was written to {out_path} (weights and recipe) and {state}"


def _report(line: str) -> None:
    print(f"mergekit-darts: {line}", file=sys.stderr)


def prepare_merge_surgery(
    block: Mapping[str, Any],
    merge_config: Any,
    out_path: str,
    options: Any,
    *,
    overwrite: bool | None = None,
    reference: str | None = None,
) -> PreparedSurgery:
    """Every check of ``block`` that can run before ``merge_config`` is merged into ``out_path``.

    ``reference`` stands in for the merge's base model when that is not on disk yet (an earlier
    ``mergekit-multi`` stage); the vocabulary checks then wait for the merged folder.
    """
    from mergekit_darts.calibrate.pipeline import prepare_surgery
    from mergekit_darts.errors import SurgeryConfigError

    if overwrite is None:
        overwrite = env_flag(OVERWRITE_ENV)
    builds_tokenizer = (
        merge_config.tokenizer is not None or merge_config.tokenizer_source is not None
    )
    if not options.copy_tokenizer and not builds_tokenizer:
        raise SurgeryConfigError(
            "surgery needs the merged model's tokenizer, but --no-copy-tokenizer leaves none in "
            "the output folder; drop the flag or set the merge's tokenizer_source"
        )
    own_tokenizer = builds_tokenizer and merge_config.tokenizer_source != "base"
    stand_in = reference is not None
    if reference is None:
        reference = reference_model(merge_config)
    prepared = prepare_surgery(
        block,
        reference=reference,
        reference_label=f"base model {reference}",
        out_path=out_path,
        overwrite=overwrite,
        check_vocab=not (own_tokenizer or stand_in),
        chat_template_set=bool(merge_config.chat_template),
    )
    _check_padding(merge_config, prepared)
    if not stand_in:  # else after the merge: the documents are checked with its tokenizer
        from mergekit_darts.hosts.lm_eval_dev import check_dev

        prepared = check_dev(prepared, reference)
    return prepared


def finish_merge_surgery(prepared: PreparedSurgery, out_path: str, options: Any) -> None:
    """The surgery on the folder ``run_merge`` just wrote.

    A folder holding two merges is refused first (``mergekit-multi``'s stages, whose merges this
    module does not wrap: by the files the load does not read).
    """
    from mergekit_darts.config import check_targets
    from mergekit_darts.folder.identity import check_one_merge
    from mergekit_darts.hosts.lm_eval_dev import check_dev
    from mergekit_darts.hosts.post_merge import run_prepared

    check_one_merge(out_path)
    # The merge may have built its own tokenizer: check the targets against what it wrote.
    targets = check_targets(
        prepared.tasks,
        str(Path(out_path).resolve()),
        f"merged model {out_path}",
        trust_remote_code=prepared.config.trust_remote_code,
        target_vocab=prepared.config.target_vocab,
        background=prepared.config.route and prepared.config.route.background,
    )
    run_prepared(
        out_path,
        check_dev(dataclasses.replace(prepared, targets=targets), str(Path(out_path).resolve())),
        progress=not options.quiet,
        write_card=options.write_model_card,
    )


def _check_padding(merge_config: Any, prepared: PreparedSurgery) -> None:
    """Refuse kl/ce before merging when ``tokenizer.pad_to_multiple_of`` must change the row count.

    The padded merged head has a multiple of ``m`` rows, so a target whose row count is not one
    cannot share its vocabulary size (the rule ``check_targets`` applies after the merge).
    """
    from mergekit_darts.config import model_shape
    from mergekit_darts.errors import SurgeryConfigError

    multiple = merge_config.tokenizer.pad_to_multiple_of if merge_config.tokenizer else None
    if not multiple:
        return
    for task in prepared.tasks:
        if task.loss not in ("kl", "ce"):
            continue
        key = f"{task.key}.target"
        rows = model_shape(
            prepared.targets[task.name], key, trust_remote_code=prepared.config.trust_remote_code
        ).vocab_size
        if rows is not None and rows % multiple:
            raise SurgeryConfigError(
                f"{task.source_key('loss')}: {task.loss} compares the merged and target "
                f"distributions over one vocabulary, but tokenizer.pad_to_multiple_of: {multiple} "
                f"pads the merged embedding rows to a multiple of {multiple} and {task.target} has "
                f"{rows}; use loss l1 or ewl1, or drop pad_to_multiple_of"
            )


def reference_model(merge_config: Any) -> str:
    """The path the targets are checked against: the base model, else the first model listed."""
    return (merge_config.base_model or _first_model(merge_config)).model.path


def _first_model(merge_config: Any) -> Any:
    """The first model the YAML lists (``referenced_models()`` is unordered)."""
    if merge_config.models:
        return merge_config.models[0].model
    if merge_config.slices:
        return merge_config.slices[0].sources[0].model
    module = next(iter(merge_config.modules.values()))
    return module.models[0].model if module.models else module.slices[0].sources[0].model
