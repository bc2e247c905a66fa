"""Calibration prompts: read records, render them to text, hash them, tokenize them.

Prompts are read before the merge starts, so a missing field or an empty file stops the run while
nothing has been written. Tokenization happens later, with the merged model's own tokenizer: the
same token ids then go to the target and to the merged model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergekit_darts.config import CalibrationConfig, ResolvedTask, prompt_file
from mergekit_darts.errors import SurgeryConfigError

LOG = logging.getLogger("mergekit_darts")


@dataclass(frozen=True)
class Prompts:
    """A task's calibration prompts, in file order, with the sha256 of each (UTF-8 text)."""

    texts: tuple[str, ...]
    sha256: tuple[str, ...]
    source: str  # as written: the file path or "dataset <id>[/<name>]:<split>"
    duplicates: int = 0  # records skipped because their prompt came earlier in the source


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def load_prompts(task: ResolvedTask) -> Prompts:
    """The first ``num_samples`` usable prompts of the task's source (fewer: a warning)."""
    return read_prompts(task.calibration, f"{task.key}.calibration", f"task {task.name!r}")


def read_prompts(cal: CalibrationConfig, key: str, who: str) -> Prompts:
    """The first ``num_samples`` usable prompts of the source ``cal`` at ``key`` (a task's
    calibration, route's background), for ``who`` (in the warning when fewer were found)."""
    if cal.path is not None:
        path = prompt_file(cal, key)
        source, records = cal.path, _file_records(path, f"{key}.path")
    else:
        source = f"dataset {cal.dataset}{f'/{cal.name}' if cal.name else ''}:{cal.split}"
        records = _dataset_records(cal, f"{key}.dataset")
    texts: dict[str, None] = {}  # insertion-ordered, and a prompt is used once
    seen = duplicates = 0
    for where, record in records:
        seen += 1
        text = _render(record, cal, key, f"{where} of {source}")
        if text in texts:
            duplicates += 1
        elif text.strip():
            texts[text] = None
            if len(texts) == cal.num_samples:
                break
    if seen == 0:
        raise SurgeryConfigError(f"{key}: {source} holds no records; give it at least one prompt")
    if not texts:
        raise SurgeryConfigError(
            f"{key}: {source} has no usable prompt (every rendered prompt is blank)"
        )
    if len(texts) < cal.num_samples:
        LOG.warning(
            "%s.num_samples: %s holds %d usable prompts, fewer than %d; calibrating %s on %d",
            key,
            source,
            len(texts),
            cal.num_samples,
            who,
            len(texts),
        )
    if duplicates:
        # a repeat would train on the prompt twice, or put a training prompt in the held-out split
        LOG.warning(
            "%s: %s repeats %d prompt(s) of earlier records; each prompt is used once",
            key,
            source,
            duplicates,
        )
    return Prompts(tuple(texts), tuple(sha256_text(t) for t in texts), source, duplicates)


def _render(record: Any, cal: CalibrationConfig, key: str, where: str) -> str:
    if isinstance(record, str):
        record = {"text": record}
    if not isinstance(record, Mapping):
        raise SurgeryConfigError(
            f"{key}: {where} is a {type(record).__name__}, not a record (an object of fields)"
        )
    if cal.template is not None:
        for name in _template_fields(cal.template):
            value = record.get(name)  # a missing field: format_map's KeyError below names it
            if name in record and (value is None or isinstance(value, Mapping | list)):
                raise _unusable_field(f"{key}.template", where, name, value)
        try:
            return cal.template.format_map(record)
        except KeyError as err:
            raise SurgeryConfigError(
                f"{key}.template: {where} has no field {err.args[0]!r} "
                f"(it has: {', '.join(map(str, record)) or 'nothing'})"
            ) from None
    field = cal.field or "text"
    if field not in record:
        raise SurgeryConfigError(
            f"{key}.field: {where} has no field {field!r} "
            f"(it has: {', '.join(map(str, record)) or 'nothing'}); set `field:` or `template:`"
        )
    value = record[field]
    if value is None:
        raise _unusable_field(f"{key}.field", where, field, value)
    if not isinstance(value, str):
        raise SurgeryConfigError(
            f"{key}.field: field {field!r} of {where} is a {type(value).__name__}, not text; "
            "use a `template:` to format it"
        )
    return value


def _template_fields(template: str) -> set[str]:
    """The record fields a template reads (the block's parser allows plain ``{field}`` only)."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def _unusable_field(key: str, where: str, name: str, value: Any) -> SurgeryConfigError:
    """A prompt would read a null field as the text "None", a list or object as its Python
    repr: refused, naming the record."""
    if value is None:
        return SurgeryConfigError(
            f"{key}: field {name!r} of {where} is null; fill it in or drop that record"
        )
    return SurgeryConfigError(
        f"{key}: field {name!r} of {where} is a {type(value).__name__}, not text or a number; "
        "a template inserts each field as text: point it at text fields"
    )


def _file_records(path: Path, key: str) -> Iterator[tuple[str, Any]]:
    """(where, record) pairs of a local file; blank lines of .jsonl/.txt are skipped."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for number, line in _utf8_lines(path, key):
            if not line.strip():
                continue
            try:
                yield f"line {number}", json.loads(line)
            except json.JSONDecodeError as err:
                raise SurgeryConfigError(
                    f"{key}: line {number} of {path.name} is not valid JSON ({err.msg})"
                ) from None
    elif suffix == ".json":
        try:
            data = json.loads("".join(line for _, line in _utf8_lines(path, key)))
        except json.JSONDecodeError as err:
            raise SurgeryConfigError(f"{key}: {path.name} is not valid JSON ({err.msg})") from None
        if not isinstance(data, list):
            raise SurgeryConfigError(f"{key}: {path.name} must hold a JSON list of records")
        yield from ((f"record {i}", record) for i, record in enumerate(data))
    elif suffix == ".txt":
        for number, line in _utf8_lines(path, key):
            if line.strip():
                yield f"line {number}", {"text": line.rstrip("\r\n")}
    else:  # .parquet, read a batch at a time
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=256)
            index = 0
            for batch in batches:
                for record in batch.to_pylist():
                    yield f"row {index}", record
                    index += 1
        except (OSError, pa.ArrowException) as err:
            detail = " ".join(str(err).split())[:200]
            raise SurgeryConfigError(
                f"{key}: cannot read {path.name} as parquet ({detail}); give a parquet file, or "
                "a .jsonl/.json/.txt file under that suffix"
            ) from None


def _utf8_lines(path: Path, key: str) -> Iterator[tuple[int, str]]:
    """Numbered lines of a UTF-8 text file, a leading byte order mark dropped (it is no part of
    the first prompt, nor of its hash); any other encoding is refused with one line."""
    number = 0
    hint = (
        "calibration text files must be UTF-8 (this one may be Latin-1 or UTF-16): save it as UTF-8"
    )
    try:
        with path.open(encoding="utf-8-sig") as lines:
            for number, line in enumerate(lines, 1):
                if "\x00" in line:  # UTF-16 text of ASCII characters decodes as UTF-8 with NULs
                    raise SurgeryConfigError(
                        f"{key}: line {number} of {path.name} holds NUL characters; {hint}"
                    )
                yield number, line
    except UnicodeDecodeError as err:
        raise SurgeryConfigError(
            f"{key}: line {number + 1} of {path.name} is not UTF-8 text ({err.reason}); {hint}"
        ) from None


def _dataset_records(cal: CalibrationConfig, key: str) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        data = datasets.load_dataset(cal.dataset, cal.name, split=cal.split)
    except Exception as err:  # not found, offline, bad split: one message for all
        message = " ".join(str(err).split())[:300]
        raise SurgeryConfigError(
            f"{key}: cannot load {cal.dataset!r} (name {cal.name!r}, split {cal.split!r}): "
            f"{message}"
        ) from None
    yield from ((f"row {i}", record) for i, record in enumerate(data))


def tokenize_prompts(
    tokenizer: Any, texts: Sequence[str], *, max_length: int, chat_template: bool, key: str
) -> list[list[int]]:
    """Token ids of each prompt, cut to its first ``max_length`` tokens.

    With ``chat_template`` each prompt becomes one user turn followed by the generation prompt,
    the way a chat model sees a question at inference.
    """
    if chat_template and not getattr(tokenizer, "chat_template", None):
        raise SurgeryConfigError(
            f"{key}.chat_template: the merged model's tokenizer has no chat template; set the "
            "merge's `chat_template:` or remove this key"
        )
    sequences = []
    for index, text in enumerate(texts):
        if chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        ids = tokenizer(text, add_special_tokens=not chat_template)["input_ids"][:max_length]
        if not ids:
            raise SurgeryConfigError(f"{key}: prompt {index} tokenizes to nothing")
        sequences.append(list(ids))
    if (distinct := len({tuple(ids) for ids in sequences})) < len(sequences):
        # the cut made them one sequence: a held-out prompt may be a trained one
        LOG.warning(
            "%s.max_length: the %d prompts are %d distinct sequences within their first %d "
            "tokens (the part calibration keeps); raise max_length or vary how prompts begin",
            key,
            len(sequences),
            distinct,
            max_length,
        )
    return sequences


def calibration_ids(task: ResolvedTask, texts: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """A task's prompt token ids, leaving room for its completion inside ``max_length``."""
    cal = task.calibration
    return tokenize_prompts(
        tokenizer,
        texts,
        max_length=cal.max_length - cal.continuation_tokens,
        chat_template=cal.chat_template,
        key=f"{task.key}.calibration",
    )
