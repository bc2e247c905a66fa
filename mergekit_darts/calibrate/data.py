"""Calibration prompts: read records, render them to text, hash them, tokenize them.

Prompts are read before the merge starts, so a missing field or an empty file stops the run while
nothing has been written. Tokenization happens later, with the merged model's own tokenizer: the
same token ids then go to the target and to the merged model.
"""

from __future__ import annotations

import hashlib
import json
import logging
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
    texts: list[str] = []
    seen = 0
    for where, record in records:
        seen += 1
        text = _render(record, cal, key, f"{where} of {source}")
        if text.strip():
            texts.append(text)
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
    return Prompts(tuple(texts), tuple(sha256_text(t) for t in texts), source)


def _render(record: Any, cal: CalibrationConfig, key: str, where: str) -> str:
    if isinstance(record, str):
        record = {"text": record}
    if not isinstance(record, Mapping):
        raise SurgeryConfigError(
            f"{key}: {where} is a {type(record).__name__}, not a record (an object of fields)"
        )
    if cal.template is not None:
        try:
            return cal.template.format_map(record)
        except KeyError as err:
            raise SurgeryConfigError(
                f"{key}.template: {where} has no field {err.args[0]!r} "
                f"(it has: {', '.join(map(str, record)) or 'nothing'})"
            ) from None
    field = cal.field or "text"
    if field not in record or record[field] is None:
        raise SurgeryConfigError(
            f"{key}.field: {where} has no field {field!r} "
            f"(it has: {', '.join(map(str, record)) or 'nothing'}); set `field:` or `template:`"
        )
    value = record[field]
    if not isinstance(value, str):
        raise SurgeryConfigError(
            f"{key}.field: field {field!r} of {where} is a {type(value).__name__}, not text; "
            "use a `template:` to format it"
        )
    return value


def _file_records(path: Path, key: str) -> Iterator[tuple[str, Any]]:
    """(where, record) pairs of a local file; blank lines of .jsonl/.txt are skipped."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
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
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise SurgeryConfigError(f"{key}: {path.name} is not valid JSON ({err.msg})") from None
        if not isinstance(data, list):
            raise SurgeryConfigError(f"{key}: {path.name} must hold a JSON list of records")
        yield from ((f"record {i}", record) for i, record in enumerate(data))
    elif suffix == ".txt":
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield f"line {number}", {"text": line.rstrip("\r\n")}
    else:  # .parquet, read a batch at a time
        import pyarrow.parquet as pq

        try:
            batches = pq.ParquetFile(path).iter_batches(batch_size=256)
            index = 0
            for batch in batches:
                for record in batch.to_pylist():
                    yield f"row {index}", record
                    index += 1
        except OSError as err:
            raise SurgeryConfigError(f"{key}: cannot read {path.name} as parquet ({err})") from None


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
