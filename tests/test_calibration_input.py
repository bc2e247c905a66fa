"""Calibration files that would calibrate on something else than the prompts.

A null field is refused (never the text "None"), a UTF-8 byte order mark is no part of the first
prompt nor of its hash, a repeated prompt is used once (so it cannot be both trained on and held
out) and reported, and a file in another encoding, or a ``.parquet`` that is not parquet, is one
line naming what is expected. Each is read through the real block parser and prompt reader.
"""

from __future__ import annotations

import json
import logging

import pytest
from tiny import surgery_block, task_prompts

from mergekit_darts import run_surgery
from mergekit_darts.calibrate.data import sha256_text
from mergekit_darts.errors import SurgeryConfigError

KEY = "surgery.tasks[0].calibration"


def refused(tmp_path, monkeypatch, calibration: dict) -> str:
    with pytest.raises(SurgeryConfigError) as info:
        task_prompts(tmp_path, monkeypatch, calibration)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_null_field_is_refused_under_a_template_and_a_field(tmp_path, monkeypatch):
    records = [{"question": "one two"}, {"question": None}]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    template = refused(tmp_path, monkeypatch, {"path": "q.jsonl", "template": "Q: {question}"})
    assert template == (
        f"{KEY}.template: field 'question' of line 2 of q.jsonl is null; fill it in or drop "
        "that record"
    )
    field = refused(tmp_path, monkeypatch, {"path": "q.jsonl", "field": "question"})
    assert field == (
        f"{KEY}.field: field 'question' of line 2 of q.jsonl is null; fill it in or drop that "
        "record"
    )


def test_a_byte_order_mark_is_no_part_of_the_first_prompt(tmp_path, monkeypatch):
    (tmp_path / "plain.txt").write_text("one two\nthree\n", encoding="utf-8")
    (tmp_path / "bom.txt").write_text("one two\nthree\n", encoding="utf-8-sig")
    (tmp_path / "bom.jsonl").write_text('{"text": "one two"}\n{"text": "three"}\n', "utf-8-sig")
    (tmp_path / "bom.json").write_text('[{"text": "one two"}, {"text": "three"}]', "utf-8-sig")
    assert (tmp_path / "bom.txt").read_bytes().startswith(b"\xef\xbb\xbf")
    for name in ("plain.txt", "bom.txt", "bom.jsonl", "bom.json"):
        texts = task_prompts(tmp_path, monkeypatch, {"path": name})
        assert texts == ("one two", "three"), name
        assert sha256_text(texts[0]) == sha256_text("one two")


@pytest.mark.parametrize(
    "name, data",
    [
        ("latin1.txt", "caf\u00e9 one\n".encode("latin-1")),
        ("utf16.txt", "one two\n".encode("utf-16")),  # with its byte order mark
        ("utf16le.jsonl", '{"text": "one"}\n'.encode("utf-16-le")),  # without: NULs
        ("latin1.json", '[{"text": "caf\u00e9"}]'.encode("latin-1")),
    ],
    ids=["latin1", "utf16", "utf16le", "latin1-json"],
)
def test_text_in_another_encoding_names_the_one_expected(tmp_path, monkeypatch, name, data):
    (tmp_path / name).write_bytes(data)
    message = refused(tmp_path, monkeypatch, {"path": name})
    assert message.startswith(f"{KEY}.path: line 1 of {name} ")
    assert message.endswith(
        "calibration text files must be UTF-8 (this one may be Latin-1 or UTF-16): save it as UTF-8"
    )


def test_a_parquet_file_that_is_not_parquet(tmp_path, monkeypatch):
    (tmp_path / "rows.parquet").write_text('{"text": "one"}\n')
    message = refused(tmp_path, monkeypatch, {"path": "rows.parquet"})
    assert message.startswith(f"{KEY}.path: cannot read rows.parquet as parquet (")


def test_repeated_prompts_are_used_once_and_reported(tmp_path, monkeypatch, caplog):
    prompts = ["one", "two", "one", "three", "two", "one", "four"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        texts = task_prompts(tmp_path, monkeypatch, {"path": "p.txt", "num_samples": 4})
    assert texts == ("one", "two", "three", "four")
    (warning,) = [r.getMessage() for r in caplog.records]
    assert (
        warning == f"{KEY}: p.txt repeats 3 prompt(s) of earlier records; each prompt is used once"
    )


@pytest.mark.slow
def test_held_out_prompts_are_never_training_prompts(tiny_family, tiny_merged, tmp_path):
    """Six records, four of them repeats: the held-out split is drawn from the distinct prompts,
    and the manifest says how many records repeated."""
    import shutil

    merged = shutil.copytree(tiny_merged, tmp_path / "merged")
    records = [tiny_family.prompts[i] for i in (0, 1, 2, 3, 0, 1, 2, 3, 0, 1)]
    (tmp_path / "p.txt").write_text("\n".join(records) + "\n")
    block = surgery_block(
        tiny_family.math,
        tmp_path / "p.txt",
        field=None,
        calibration={"max_length": 16},
        task={"holdout": 0.5},
        steps=2,
        batch_size=2,
    )
    written = run_surgery(merged, block, progress=False)
    entry = written["tasks"]["math"]
    calibration = entry["calibration"]
    assert calibration["num_prompts"] == 4 and calibration["duplicate_records"] == 6
    assert len(set(calibration["prompt_sha256"])) == 4
    assert entry["held_out"]  # measured on 2 of the 4 distinct prompts


# ---- found by the fresh probe ------------------------------------------------------------------


def test_a_template_field_that_is_a_list_or_object_is_refused(tmp_path, monkeypatch):
    """Not the text "Q: [1, 2]" for every record (which the dedupe would then fold into one)."""
    for value, kind in (([1, 2], "list"), ({"a": 1}, "dict")):
        (tmp_path / "q.jsonl").write_text(json.dumps({"q": value}) + "\n")
        message = refused(tmp_path, monkeypatch, {"path": "q.jsonl", "template": "Q: {q}"})
        assert message == (
            f"{KEY}.template: field 'q' of line 1 of q.jsonl is a {kind}, not text or a number; "
            "a template inserts each field as text: point it at text fields"
        )
    (tmp_path / "q.jsonl").write_text(json.dumps({"q": 3}) + "\n")  # numbers are fine
    assert task_prompts(tmp_path, monkeypatch, {"path": "q.jsonl", "template": "Q: {q}"}) == (
        "Q: 3",
    )


def test_prompts_cut_to_one_sequence_are_reported(caplog):
    """Distinct prompts that max_length cuts to the same tokens: a held-out row would be a
    trained one."""
    from tiny import build_tokenizer

    from mergekit_darts.calibrate.data import tokenize_prompts

    texts = ["one two three four cat", "one two three four dog", "five six"]
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        ids = tokenize_prompts(build_tokenizer(), texts, max_length=4, chat_template=False, key="k")
    assert ids[0] == ids[1] != ids[2]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning == (
        "k.max_length: the 3 prompts are 2 distinct sequences within their first 4 tokens (the "
        "part calibration keeps); raise max_length or vary how prompts begin"
    )
    caplog.clear()
    tokenize_prompts(build_tokenizer(), texts, max_length=8, chat_template=False, key="k")
    assert not caplog.records
