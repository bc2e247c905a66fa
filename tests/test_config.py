"""The `surgery:` block: every bad input stops the run with one line naming the key, before any
merge work, with nothing written; good inputs of every supported kind load as expected."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from tiny import (
    build_tokenizer,
    change_block,
    change_task,
    merge_config,
    refuse,
    task_prompts,
)

from mergekit_darts.calibrate.data import tokenize_prompts
from mergekit_darts.calibrate.pipeline import prepare_surgery
from mergekit_darts.config import parse_surgery, read_surgery_file, resolve_tasks
from mergekit_darts.errors import SurgeryConfigError, SurgeryFormatError
from mergekit_darts.folder.manifest import Manifest
from mergekit_darts.hosts.mergekit.hook import prepare_merge_surgery
from mergekit_darts.hosts.post_merge import run_surgery
from mergekit_darts.task_map import DoubleClaim, eval_task_map, manifest_task_map

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def t5_merge(config: dict, odd: Path) -> None:
    """The merge's models become an encoder-decoder (the targets stay causal LMs)."""
    config["base_model"] = str(odd / "t5")
    for entry in config["models"]:
        entry["model"] = str(odd / "t5")


def calibration_file(name: str) -> Callable[[Path], dict]:
    return lambda odd: {"path": str(odd / name), "field": None, "template": None}


BAD_INPUTS = [
    ("unknown key", change_block(rnak=16), "surgery.rnak: unknown key; allowed here: module, loss"),
    (
        "unknown key in calibration",
        change_task(0, calibration={"samples": 3}),
        "surgery.tasks[0].calibration.samples: unknown key",
    ),
    (
        "unknown module",
        change_block(module="lora"),
        "surgery.module: 'lora' is not allowed; choose one",
    ),
    ("unknown loss", change_task(1, loss="mse"), "surgery.tasks[1].loss: 'mse' is not allowed"),
    ("rank zero", change_block(rank=0), "surgery.rank: must be > 0 (got 0)"),
    ("negative task rank", change_task(0, rank=-4), "surgery.tasks[0].rank: must be > 0 (got -4)"),
    ("rank not an int", change_block(rank="16"), "surgery.rank: input should be a valid integer"),
    ("no tasks", change_block(tasks=[]), "surgery.tasks: must not be empty"),
    ("target key missing", change_task(0, target=None), "surgery.tasks[0].target: required key"),
    (
        "missing target folder",
        change_task(1, target=lambda odd: str(odd / "nowhere")),
        "surgery.tasks[1].target: no model folder at",
    ),
    (
        "other hidden size",
        change_task(0, target=lambda odd: str(odd / "wide")),
        "surgery.tasks[0].target: ",
    ),
    (
        "other vocab size under kl",  # padded rows are fine for l1/ewl1 (test_target_vocab.py)
        change_task(0, target=lambda odd: str(odd / "bigvocab"), loss="kl"),
        "surgery.tasks[0].target: ",
    ),
    (
        "other tokenizer",
        change_task(1, target=lambda odd: str(odd / "othertok")),
        "surgery.tasks[1].target: the tokenizer of ",
    ),
    (
        "missing calibration file",
        change_task(0, calibration=calibration_file("missing.jsonl")),
        "surgery.tasks[0].calibration.path: no file at",
    ),
    (
        "empty calibration file",
        change_task(0, calibration=calibration_file("empty.jsonl")),
        "surgery.tasks[0].calibration.path: ",
    ),
    (
        "missing field in a record",
        change_task(1, calibration=calibration_file("nofield.jsonl")),
        "surgery.tasks[1].calibration.field: line 2 of ",
    ),
    (
        "template field missing",
        change_task(0, calibration={"field": None, "template": "{question} {answer}"}),
        "surgery.tasks[0].calibration.template: line 1 of ",
    ),
    (
        "no usable prompt",
        change_task(0, calibration=calibration_file("blank.jsonl")),
        "surgery.tasks[0].calibration: ",
    ),
    (
        "invalid json line",
        change_task(0, calibration=calibration_file("broken.jsonl")),
        "surgery.tasks[0].calibration.path: line 2 of broken.jsonl is not valid JSON",
    ),
    (
        "unsupported suffix",
        change_task(0, calibration=calibration_file("prompts.csv")),
        "surgery.tasks[0].calibration.path: ",
    ),
    (
        "field and template",
        change_task(0, calibration={"template": "{question}"}),
        "surgery.tasks[0].calibration.template: give `field:` or `template:`, not both",
    ),
    (
        "two sources",
        change_task(0, calibration={"dataset": "gsm8k", "split": "test"}),
        "surgery.tasks[0].calibration: give exactly one source",
    ),
    (
        "dataset without split",
        change_task(0, calibration={"path": None, "dataset": "gsm8k"}),
        "surgery.tasks[0].calibration.split: required with `dataset:`",
    ),
    (
        "max_length above max_positions",
        change_task(0, calibration={"max_length": 600}),
        "surgery.tasks[0].calibration.max_length: 600 exceeds max_positions 512 (the position "
        "table cannot cover it); lower max_length or raise max_positions",
    ),
    (
        "max_length above a task's max_positions",
        change_task(1, max_positions=16),
        "surgery.tasks[1].calibration.max_length: 512 exceeds max_positions 16",
    ),
    (
        "duplicate task names",
        change_task(1, name="math"),
        "surgery.tasks[1].name: duplicate task name",
    ),
    (
        "reserved task name",
        change_task(0, name="auto"),
        "surgery.tasks[0].name: 'auto' is reserved",
    ),
    (
        "task name with comma",
        change_task(0, name="a,b"),
        "surgery.tasks[0].name: 'a,b' is not a valid",
    ),
    (
        "eval task served twice",
        change_task(1, eval_tasks=["humaneval", "math"]),
        "surgery.tasks[1].eval_tasks: lm-eval task 'math' is already served by task 'math'",
    ),
    (
        "eval task listed twice by one task",
        change_task(0, eval_tasks=["gsm8k", "gsm8k"]),
        "surgery.tasks[0].eval_tasks: lm-eval task 'gsm8k' is listed twice; list it once",
    ),
    ("bad device", change_block(device="gpu"), "surgery.device: 'gpu' is not a device"),
    # generation-aware calibration
    (
        "completion loss without continuation (block)",
        change_block(loss_positions="completion"),
        "surgery.loss_positions: `completion` needs surgery.tasks[0].calibration."
        "continuation_tokens > 0",
    ),
    (
        "completion loss without continuation (task)",
        change_task(1, loss_positions="completion"),
        "surgery.tasks[1].loss_positions: `completion` needs surgery.tasks[1].calibration."
        "continuation_tokens > 0",
    ),
    (
        "unknown loss_positions",
        change_task(0, loss_positions="answer"),
        "surgery.tasks[0].loss_positions: 'answer' is not allowed; choose one of all or completion",
    ),
    (
        "continuation fills max_length",
        change_task(0, calibration={"continuation_tokens": 64, "max_length": 64}),
        "surgery.tasks[0].calibration.continuation_tokens: 64 leaves no room for the prompt",
    ),
    (
        "negative continuation",
        change_task(0, calibration={"continuation_tokens": -1}),
        "surgery.tasks[0].calibration.continuation_tokens: must be >= 0",
    ),
    # checks that must run before the merge and end in one line, never a traceback
    ("encoder-decoder merge", t5_merge, "base model "),
    (
        "encoder-decoder target",
        change_task(1, target=lambda odd: str(odd / "t5")),
        "surgery.tasks[1].target: ",
    ),
    (
        "chat_template without one",
        change_task(0, calibration={"chat_template": True}),
        "surgery.tasks[0].calibration.chat_template: the base model ",
    ),
    (
        "template with a format spec",
        change_task(1, calibration={"template": "{question:d}"}),
        "surgery.tasks[1].calibration.template: {question:d} has a format spec or conversion; use "
        "the plain placeholder {question}",
    ),
    (
        "template with a conversion",
        change_task(1, calibration={"template": "Q: {question!r}"}),
        "surgery.tasks[1].calibration.template: {question!r} has a format spec",
    ),
    (
        "rank above the hidden size",
        change_block(rank=1000),
        "surgery.rank: rank 1000 exceeds the hidden size 64 of the base model ",
    ),
    (
        "task rank above the hidden size",
        change_task(1, rank=65),
        "surgery.tasks[1].rank: rank 65 exceeds the hidden size 64",
    ),
    (
        "candidate rank above the hidden size",
        change_task(0, select={"candidates": [{"rank": 4}, {"rank": 128}]}),
        "surgery.tasks[0].select.candidates[1].rank: rank 128 exceeds the hidden size 64",
    ),
    (
        "max_length 1 keeps only BOS",
        change_task(0, calibration={"max_length": 1}),
        "surgery.tasks[0].calibration.max_length: 1 leaves no token to train on after the first "
        "(BOS) token",
    ),
    (
        "continuation leaves only BOS for the prompt",
        change_task(0, calibration={"continuation_tokens": 63, "max_length": 64}),
        "surgery.tasks[0].calibration.continuation_tokens: 63 leaves no room for the prompt",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "expected"), [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_input_is_one_line_before_merging(
    tiny_family, calibration_data, odd, tmp_path, mutate, expected
):
    config = merge_config(tiny_family, calibration_data)
    mutate(config, odd)
    for entry in config["surgery"]["tasks"]:  # drop keys a mutation set to None
        entry["calibration"] = {k: v for k, v in entry["calibration"].items() if v is not None}
    message = refuse(config, tmp_path / "out")
    assert message.startswith(expected), message


def test_size_messages_name_both_sizes(tiny_family, calibration_data, odd, tmp_path):
    config = merge_config(tiny_family, calibration_data)
    config["surgery"]["tasks"][0]["target"] = str(odd / "wide")
    message = refuse(config, tmp_path / "out")
    assert "hidden_size 32" in message and "has 64" in message
    config["surgery"]["tasks"][0].update(target=str(odd / "bigvocab"), loss="ce")
    message = refuse(config, tmp_path / "out")
    assert f"vocab_size {len(build_tokenizer()) + 8}" in message
    assert f"has {len(build_tokenizer())}" in message


def test_existing_surgery_folder_is_refused_before_merging(tiny_family, calibration_data, tmp_path):
    out = tmp_path / "out"
    (out / "surgery").mkdir(parents=True)
    (out / "surgery" / "manifest.json").write_text("{}")
    message = refuse(merge_config(tiny_family, calibration_data), out)
    assert message.startswith(f"{out / 'surgery'} already exists")
    assert "--overwrite-surgery" in message and "DARTS_OVERWRITE_SURGERY=1" in message
    assert not (out / "model.safetensors").exists()


def test_block_that_is_not_a_mapping(tiny_family, calibration_data, tmp_path):
    config = merge_config(tiny_family, calibration_data)
    config["surgery"] = ["math"]
    assert refuse(config, tmp_path / "out").startswith("surgery: expected a mapping")


def test_fewer_records_than_num_samples_warns_and_uses_them(
    tiny_family, calibration_data, tmp_path, caplog
):
    config = merge_config(tiny_family, calibration_data)["surgery"]
    config["tasks"][0]["calibration"]["num_samples"] = 500
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        prepared = prepare_surgery(
            config, reference=str(tiny_family.base), reference_label="base", out_path=tmp_path
        )
    assert len(prepared.prompts["math"].texts) == len(tiny_family.prompts)
    warning = next(r.getMessage() for r in caplog.records if "num_samples" in r.getMessage())
    assert warning.startswith("surgery.tasks[0].calibration.num_samples: ")
    assert f"holds {len(tiny_family.prompts)} usable prompts, fewer than 500" in warning
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_stock_mergekit_yaml_prints_one_line_and_writes_nothing(
    tiny_family, calibration_data, tmp_path
):
    config = merge_config(tiny_family, calibration_data)
    config["surgery"]["tasks"][0]["calibration"]["max_length"] = 600
    (tmp_path / "merge.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if k != "DARTS_NO_HOOK"}
    done = subprocess.run(
        [str(BIN / "mergekit-yaml"), "merge.yml", "out"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "Error: surgery.tasks[0].calibration.max_length: 600 exceeds max_positions 512 (the "
        "position table cannot cover it); lower max_length or raise max_positions"
    )
    assert not (tmp_path / "out").exists()


# ---- good inputs ---------------------------------------------------------------------------------


def test_defaults_and_overrides():
    config = parse_surgery(
        {
            "rank": 8,
            "tasks": [
                {"name": "a", "target": "./a", "calibration": {"path": "a.jsonl"}},
                {
                    "name": "b",
                    "target": "./b",
                    "eval_tasks": ["gsm8k", "gsm8k_cot"],
                    "module": "standard",
                    "lr": "1e-3",  # how YAML reads 1e-3
                    "calibration": {"path": "b.txt", "continuation_tokens": 8},
                    "loss_positions": "completion",
                },
            ],
        }
    )
    a, b = resolve_tasks(config)
    assert (a.module, a.loss, a.rank, a.max_positions, a.steps, a.lr) == (
        "pos_corr",
        "ewl1",
        8,
        512,
        500,
        1e-3,
    )
    assert (a.batch_size, a.seed, a.loss_positions, a.eval_tasks) == (8, 0, "all", ("a",))
    assert (a.calibration.num_samples, a.calibration.max_length) == (50, 512)
    assert a.calibration.continuation_tokens == 0 and not a.calibration.chat_template
    assert (config.device, config.cache_dtype, config.trust_remote_code) == (
        "auto",
        "bfloat16",
        False,
    )
    assert (b.module, b.rank, b.lr, b.eval_tasks) == ("standard", 8, 1e-3, ("gsm8k", "gsm8k_cot"))
    assert b.loss_positions == "completion"


def test_block_and_manifest_share_the_routing_rule():
    """One lm-eval task, one module: the block refuses at parse time what hf-darts would refuse
    in a manifest, through the one rule in mergekit_darts.task_map."""
    claims = [("math", ["gsm8k"]), ("code", None), ("math2", ["mbpp", "gsm8k"])]
    assert eval_task_map(claims[:2]) == {"gsm8k": "math", "code": "code"}
    with pytest.raises(DoubleClaim) as info:
        eval_task_map(claims)
    assert (info.value.eval_task, info.value.first, info.value.second) == ("gsm8k", "math", "math2")
    entry = {"module": "pos_corr", "rank": 2, "max_positions": 4}
    tasks = {name: {**entry, "eval_tasks": tasks or []} for name, tasks in claims}
    manifest = Manifest.from_dict({"hidden_size": 8, "tasks": tasks})
    with pytest.raises(SurgeryFormatError, match="'gsm8k' is served by surgery tasks 'math' and"):
        manifest_task_map(manifest)
    block = {
        "tasks": [
            {"name": name, "target": "t", "eval_tasks": tasks, "calibration": {"path": "x.txt"}}
            for name, tasks in claims
        ]
    }
    with pytest.raises(SurgeryConfigError) as info:
        parse_surgery(block)
    assert str(info.value) == (
        "surgery.tasks[2].eval_tasks: lm-eval task 'gsm8k' is already served by task 'math'; "
        "each lm-eval task may pick one module"
    )


def test_surgery_file_may_be_a_merge_yaml_or_the_block(tmp_path):
    block = {"tasks": [{"name": "a", "target": "./a", "calibration": {"path": "a.jsonl"}}]}
    (tmp_path / "full.yml").write_text(yaml.safe_dump({"merge_method": "linear", "surgery": block}))
    (tmp_path / "block.yml").write_text(yaml.safe_dump(block))
    (tmp_path / "none.yml").write_text(yaml.safe_dump({"merge_method": "linear"}))
    assert read_surgery_file(tmp_path / "full.yml") == block
    assert read_surgery_file(tmp_path / "block.yml") == block
    with pytest.raises(SurgeryConfigError, match="holds no surgery block"):
        read_surgery_file(tmp_path / "none.yml")


def test_every_file_format_and_template(tmp_path, monkeypatch):
    records = [{"q": "one two", "a": "three"}, {"q": "four", "a": "five"}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    (tmp_path / "r.json").write_text(json.dumps(records))
    (tmp_path / "r.txt").write_text("one two\n\nfour\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), tmp_path / "r.parquet")
    for name in ("r.jsonl", "r.json", "r.parquet"):
        assert task_prompts(tmp_path, monkeypatch, {"path": name, "field": "q"}) == (
            "one two",
            "four",
        )
        rendered = task_prompts(tmp_path, monkeypatch, {"path": name, "template": "Q: {q} A: {a}"})
        assert rendered == ("Q: one two A: three", "Q: four A: five")
    assert task_prompts(tmp_path, monkeypatch, {"path": "r.txt"}) == ("one two", "four")
    assert task_prompts(tmp_path, monkeypatch, {"path": "r.txt", "num_samples": 1}) == ("one two",)


def test_datasets_source(tmp_path, monkeypatch):
    folder = tmp_path / "local_dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    texts = task_prompts(tmp_path, monkeypatch, {"dataset": str(folder), "split": "train"})
    assert texts == ("one", "two")
    with pytest.raises(SurgeryConfigError, match=r"^surgery.tasks\[0\].calibration.dataset: "):
        task_prompts(tmp_path, monkeypatch, {"dataset": str(folder), "split": "validation"})


def test_prompt_hashes(tiny_family, calibration_data, tmp_path):
    config = merge_config(tiny_family, calibration_data)["surgery"]
    prepared = prepare_surgery(
        config, reference=str(tiny_family.base), reference_label="base", out_path=tmp_path
    )
    expected = [hashlib.sha256(p.encode()).hexdigest() for p in tiny_family.prompts]
    assert list(prepared.prompts["math"].sha256) == expected


def test_chat_template_needs_one():
    tokenizer = build_tokenizer()
    with pytest.raises(SurgeryConfigError, match=r"^k.chat_template: the merged model's tokenizer"):
        tokenize_prompts(tokenizer, ["one"], max_length=8, chat_template=True, key="k")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} ? {% endfor %}"
    ids = tokenize_prompts(tokenizer, ["one two"], max_length=8, chat_template=True, key="k")
    assert tokenizer.convert_ids_to_tokens(ids[0]) == ["one", "two", "?"]
    cut = tokenize_prompts(tokenizer, ["one two three"], max_length=2, chat_template=False, key="k")
    assert tokenizer.convert_ids_to_tokens(cut[0]) == ["<s>", "one"]


def test_example_yaml_validates(tiny_family, tmp_path, monkeypatch):
    """examples/merge_with_surgery.yml works in a folder laid out like the tiny family."""
    for name in ("base", "math", "code"):
        (tmp_path / name).symlink_to(getattr(tiny_family, name))
    shutil.copytree(REPO / "examples" / "data", tmp_path / "data")
    source = (REPO / "examples" / "merge_with_surgery.yml").read_text()
    monkeypatch.chdir(tmp_path)
    merge = MergeConfiguration.model_validate(yaml.safe_load(source))
    block = copy.deepcopy(yaml.safe_load(source)["surgery"])
    prepared = prepare_surgery(
        block, reference=merge.base_model.model.path, reference_label="base", out_path="out"
    )
    assert [t.name for t in prepared.tasks] == ["math", "code"]
    assert all(len(p.texts) > 0 for p in prepared.prompts.values())


def test_encoder_decoder_messages_say_why(tiny_family, calibration_data, odd, tmp_path):
    config = merge_config(tiny_family, calibration_data)
    t5_merge(config, odd)
    message = refuse(config, tmp_path / "out")
    assert message.startswith(
        f"base model {odd / 't5'} is an encoder-decoder model (model_type t5)"
    )
    assert "decoder-only causal LM" in message and "without a surgery: block" in message


def test_chat_template_set_by_the_merge_passes_preflight(tiny_family, calibration_data, tmp_path):
    """mergekit's `chat_template:` gives the merged tokenizer one the base lacks."""
    config = merge_config(tiny_family, calibration_data)
    config["surgery"]["tasks"][0]["calibration"]["chat_template"] = True
    config["chat_template"] = "chatml"
    prepared = prepare_merge_surgery(
        config["surgery"],
        MergeConfiguration.model_validate(config),
        str(tmp_path / "out"),
        MergeOptions(quiet=True),
    )
    assert prepared.tasks[0].calibration.chat_template
    assert not (tmp_path / "out").exists()


def test_chat_template_checked_against_a_merged_folder(tiny_family, tiny_merged, calibration_data):
    """`calibrate` on a merged folder without a template stops before any model loads."""
    block = merge_config(tiny_family, calibration_data)["surgery"]
    block["tasks"][1]["calibration"]["chat_template"] = True
    with pytest.raises(SurgeryConfigError) as info:
        run_surgery(tiny_merged, block)
    assert str(info.value).startswith(
        f"surgery.tasks[1].calibration.chat_template: the merged model {tiny_merged} has no chat "
        "template"
    )
    assert not (tiny_merged / "surgery").exists()
