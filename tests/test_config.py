"""The `surgery:` block: every bad input stops the run with one line naming the key, before any
merge work, with nothing written; good inputs of every supported kind load as expected."""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import mergekit.merge
import pytest
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from tiny import build_tokenizer, save_model, tiny_config
from transformers import LlamaForCausalLM, T5Config

from mergekit_darts.calibrate.data import load_prompts, tokenize_prompts
from mergekit_darts.calibrate.pipeline import prepare_surgery
from mergekit_darts.config import parse_surgery, read_surgery_file, resolve_tasks
from mergekit_darts.errors import SurgeryConfigError, SurgeryFormatError
from mergekit_darts.integrations.mergekit_hook import merge_with_surgery, prepare_merge_surgery
from mergekit_darts.integrations.post_merge import run_surgery
from mergekit_darts.manifest import Manifest
from mergekit_darts.task_map import DoubleClaim, eval_task_routes, manifest_routes

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def odd(tiny_family, tmp_path_factory) -> Path:
    """Models and files that must be refused: other sizes, another tokenizer, broken data."""
    root = tmp_path_factory.mktemp("odd")
    tokenizer = build_tokenizer()
    save_model(root / "wide", tokenizer, seed=3, hidden_size=32)
    LlamaForCausalLM(tiny_config(len(tokenizer) + 8)).save_pretrained(root / "bigvocab")
    tokenizer.save_pretrained(root / "bigvocab")
    save_model(root / "othertok", tokenizer, seed=4)
    spec = json.loads((root / "othertok" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]
    (root / "othertok" / "tokenizer.json").write_text(json.dumps(spec))
    (root / "empty.jsonl").write_text("")
    (root / "blank.jsonl").write_text('{"text": "  "}\n{"text": ""}\n')
    (root / "nofield.jsonl").write_text('{"text": "one two"}\n{"prompt": "three"}\n')
    (root / "broken.jsonl").write_text('{"text": "one"}\n{"text": \n')
    (root / "prompts.csv").write_text("text\none two\n")
    # an encoder-decoder of the family's hidden size and tokenizer (a config is all preflight reads)
    T5Config(
        vocab_size=len(tokenizer), d_model=64, d_kv=16, d_ff=128, num_layers=1, num_heads=4
    ).save_pretrained(root / "t5")
    tokenizer.save_pretrained(root / "t5")
    return root


def merge_config(family, data: Path) -> dict:
    """A valid merge YAML (as a dict) with a two-task surgery block."""
    return {
        "merge_method": "task_arithmetic",
        "base_model": str(family.base),
        "models": [
            {"model": str(family.math), "parameters": {"weight": 0.5}},
            {"model": str(family.code), "parameters": {"weight": 0.5}},
        ],
        "dtype": "float32",
        "surgery": {
            "steps": 5,
            "tasks": [
                {
                    "name": "math",
                    "target": str(family.math),
                    "calibration": {"path": str(data / "math.jsonl"), "field": "question"},
                },
                {
                    "name": "code",
                    "target": str(family.code),
                    "calibration": {"path": str(data / "code.jsonl"), "template": "{question}"},
                },
            ],
        },
    }


def merge(config: dict, out: Path) -> dict:
    """Run the hook's merge path (real mergekit, then the surgery); returns the manifest."""
    merge_with_surgery(
        inspect.unwrap(mergekit.merge.run_merge),
        MergeConfiguration.model_validate(config),
        str(out),
        MergeOptions(quiet=True),
        yaml.safe_dump(config, sort_keys=False),
    )
    return json.loads((out / "surgery" / "manifest.json").read_text())


def refuse(config: dict, out: Path) -> str:
    """Run the hook's merge path with the real mergekit; it must fail before writing anything."""
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    with pytest.raises(SurgeryConfigError) as info:
        merge(config, out)
    after = sorted(p.name for p in out.iterdir()) if out.exists() else None
    assert after == before, "a refused surgery block must leave the output folder untouched"
    message = str(info.value)
    assert "\n" not in message
    return message


def task(index: int, **changes) -> Callable[[dict, Path], None]:
    """A mutation updating ``surgery.tasks[index]`` (``calibration`` is merged, not replaced)."""

    def mutate(config: dict, odd: Path) -> None:
        entry = config["surgery"]["tasks"][index]
        for key, value in changes.items():
            value = value(odd) if callable(value) else value
            if key == "calibration":
                entry["calibration"].update(value)
            elif value is None:
                entry.pop(key)
            else:
                entry[key] = value

    return mutate


def block(**changes) -> Callable[[dict, Path], None]:
    def mutate(config: dict, odd: Path) -> None:
        config["surgery"].update(changes)

    return mutate


def t5_merge(config: dict, odd: Path) -> None:
    """The merge's models become an encoder-decoder (the targets stay causal LMs)."""
    config["base_model"] = str(odd / "t5")
    for entry in config["models"]:
        entry["model"] = str(odd / "t5")


def calibration_file(name: str) -> Callable[[Path], dict]:
    return lambda odd: {"path": str(odd / name), "field": None, "template": None}


BAD_INPUTS = [
    ("unknown key", block(rnak=16), "surgery.rnak: unknown key; allowed here: module, loss"),
    (
        "unknown key in calibration",
        task(0, calibration={"samples": 3}),
        "surgery.tasks[0].calibration.samples: unknown key",
    ),
    ("unknown module", block(module="lora"), "surgery.module: 'lora' is not allowed; choose one"),
    ("unknown loss", task(1, loss="mse"), "surgery.tasks[1].loss: 'mse' is not allowed"),
    ("rank zero", block(rank=0), "surgery.rank: must be > 0 (got 0)"),
    ("negative task rank", task(0, rank=-4), "surgery.tasks[0].rank: must be > 0 (got -4)"),
    ("rank not an int", block(rank="16"), "surgery.rank: input should be a valid integer"),
    ("no tasks", block(tasks=[]), "surgery.tasks: must not be empty"),
    ("target key missing", task(0, target=None), "surgery.tasks[0].target: required key"),
    (
        "missing target folder",
        task(1, target=lambda odd: str(odd / "nowhere")),
        "surgery.tasks[1].target: no model folder at",
    ),
    (
        "other hidden size",
        task(0, target=lambda odd: str(odd / "wide")),
        "surgery.tasks[0].target: ",
    ),
    (
        "other vocab size under kl",  # padded rows are fine for l1/ewl1 (test_target_vocab.py)
        task(0, target=lambda odd: str(odd / "bigvocab"), loss="kl"),
        "surgery.tasks[0].target: ",
    ),
    (
        "other tokenizer",
        task(1, target=lambda odd: str(odd / "othertok")),
        "surgery.tasks[1].target: the tokenizer of ",
    ),
    (
        "missing calibration file",
        task(0, calibration=calibration_file("missing.jsonl")),
        "surgery.tasks[0].calibration.path: no file at",
    ),
    (
        "empty calibration file",
        task(0, calibration=calibration_file("empty.jsonl")),
        "surgery.tasks[0].calibration.path: ",
    ),
    (
        "missing field in a record",
        task(1, calibration=calibration_file("nofield.jsonl")),
        "surgery.tasks[1].calibration.field: line 2 of ",
    ),
    (
        "template field missing",
        task(0, calibration={"field": None, "template": "{question} {answer}"}),
        "surgery.tasks[0].calibration.template: line 1 of ",
    ),
    (
        "no usable prompt",
        task(0, calibration=calibration_file("blank.jsonl")),
        "surgery.tasks[0].calibration: ",
    ),
    (
        "invalid json line",
        task(0, calibration=calibration_file("broken.jsonl")),
        "surgery.tasks[0].calibration.path: line 2 of broken.jsonl is not valid JSON",
    ),
    (
        "unsupported suffix",
        task(0, calibration=calibration_file("prompts.csv")),
        "surgery.tasks[0].calibration.path: ",
    ),
    (
        "field and template",
        task(0, calibration={"template": "{question}"}),
        "surgery.tasks[0].calibration.template: give `field:` or `template:`, not both",
    ),
    (
        "two sources",
        task(0, calibration={"dataset": "gsm8k", "split": "test"}),
        "surgery.tasks[0].calibration: give exactly one source",
    ),
    (
        "dataset without split",
        task(0, calibration={"path": None, "dataset": "gsm8k"}),
        "surgery.tasks[0].calibration.split: required with `dataset:`",
    ),
    (
        "max_length above max_positions",
        task(0, calibration={"max_length": 600}),
        "surgery.tasks[0].calibration.max_length: 600 exceeds max_positions 512 (the position "
        "table cannot cover it); lower max_length or raise max_positions",
    ),
    (
        "max_length above a task's max_positions",
        task(1, max_positions=16),
        "surgery.tasks[1].calibration.max_length: 512 exceeds max_positions 16",
    ),
    ("duplicate task names", task(1, name="math"), "surgery.tasks[1].name: duplicate task name"),
    ("reserved task name", task(0, name="auto"), "surgery.tasks[0].name: 'auto' is reserved"),
    ("task name with comma", task(0, name="a,b"), "surgery.tasks[0].name: 'a,b' is not a valid"),
    (
        "eval task served twice",
        task(1, eval_tasks=["humaneval", "math"]),
        "surgery.tasks[1].eval_tasks: lm-eval task 'math' is already served by task 'math'",
    ),
    (
        "eval task listed twice by one task",
        task(0, eval_tasks=["gsm8k", "gsm8k"]),
        "surgery.tasks[0].eval_tasks: lm-eval task 'gsm8k' is listed twice; list it once",
    ),
    ("bad device", block(device="gpu"), "surgery.device: 'gpu' is not a device"),
    # generation-aware calibration
    (
        "completion loss without continuation (block)",
        block(loss_positions="completion"),
        "surgery.loss_positions: `completion` needs surgery.tasks[0].calibration."
        "continuation_tokens > 0",
    ),
    (
        "completion loss without continuation (task)",
        task(1, loss_positions="completion"),
        "surgery.tasks[1].loss_positions: `completion` needs surgery.tasks[1].calibration."
        "continuation_tokens > 0",
    ),
    (
        "unknown loss_positions",
        task(0, loss_positions="answer"),
        "surgery.tasks[0].loss_positions: 'answer' is not allowed; choose one of all or completion",
    ),
    (
        "continuation fills max_length",
        task(0, calibration={"continuation_tokens": 64, "max_length": 64}),
        "surgery.tasks[0].calibration.continuation_tokens: 64 leaves no room for the prompt",
    ),
    (
        "negative continuation",
        task(0, calibration={"continuation_tokens": -1}),
        "surgery.tasks[0].calibration.continuation_tokens: must be >= 0",
    ),
    # checks that must run before the merge and end in one line, never a traceback
    ("encoder-decoder merge", t5_merge, "base model "),
    (
        "encoder-decoder target",
        task(1, target=lambda odd: str(odd / "t5")),
        "surgery.tasks[1].target: ",
    ),
    (
        "chat_template without one",
        task(0, calibration={"chat_template": True}),
        "surgery.tasks[0].calibration.chat_template: the base model ",
    ),
    (
        "template with a format spec",
        task(1, calibration={"template": "{question:d}"}),
        "surgery.tasks[1].calibration.template: {question:d} has a format spec or conversion; use "
        "the plain placeholder {question}",
    ),
    (
        "template with a conversion",
        task(1, calibration={"template": "Q: {question!r}"}),
        "surgery.tasks[1].calibration.template: {question!r} has a format spec",
    ),
    (
        "rank above the hidden size",
        block(rank=1000),
        "surgery.rank: rank 1000 exceeds the hidden size 64 of the base model ",
    ),
    (
        "task rank above the hidden size",
        task(1, rank=65),
        "surgery.tasks[1].rank: rank 65 exceeds the hidden size 64",
    ),
    (
        "candidate rank above the hidden size",
        task(0, select={"candidates": [{"rank": 4}, {"rank": 128}]}),
        "surgery.tasks[0].select.candidates[1].rank: rank 128 exceeds the hidden size 64",
    ),
    (
        "max_length 1 keeps only BOS",
        task(0, calibration={"max_length": 1}),
        "surgery.tasks[0].calibration.max_length: 1 leaves no token to train on after the first "
        "(BOS) token",
    ),
    (
        "continuation leaves only BOS for the prompt",
        task(0, calibration={"continuation_tokens": 63, "max_length": 64}),
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
    assert eval_task_routes(claims[:2]) == {"gsm8k": "math", "code": "code"}
    with pytest.raises(DoubleClaim) as info:
        eval_task_routes(claims)
    assert (info.value.eval_task, info.value.first, info.value.second) == ("gsm8k", "math", "math2")
    entry = {"module": "pos_corr", "rank": 2, "max_positions": 4}
    tasks = {name: {**entry, "eval_tasks": tasks or []} for name, tasks in claims}
    manifest = Manifest.from_dict({"hidden_size": 8, "tasks": tasks})
    with pytest.raises(SurgeryFormatError, match="'gsm8k' is served by surgery tasks 'math' and"):
        manifest_routes(manifest)
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


def _prompts(tmp_path, monkeypatch, calibration: dict) -> tuple[str, ...]:
    monkeypatch.chdir(tmp_path)  # relative paths resolve from the working directory
    config = parse_surgery({"tasks": [{"name": "t", "target": "./t", "calibration": calibration}]})
    return load_prompts(resolve_tasks(config)[0]).texts


def test_every_file_format_and_template(tmp_path, monkeypatch):
    records = [{"q": "one two", "a": "three"}, {"q": "four", "a": "five"}]
    (tmp_path / "r.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    (tmp_path / "r.json").write_text(json.dumps(records))
    (tmp_path / "r.txt").write_text("one two\n\nfour\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), tmp_path / "r.parquet")
    for name in ("r.jsonl", "r.json", "r.parquet"):
        assert _prompts(tmp_path, monkeypatch, {"path": name, "field": "q"}) == ("one two", "four")
        rendered = _prompts(tmp_path, monkeypatch, {"path": name, "template": "Q: {q} A: {a}"})
        assert rendered == ("Q: one two A: three", "Q: four A: five")
    assert _prompts(tmp_path, monkeypatch, {"path": "r.txt"}) == ("one two", "four")
    assert _prompts(tmp_path, monkeypatch, {"path": "r.txt", "num_samples": 1}) == ("one two",)


def test_datasets_source(tmp_path, monkeypatch):
    folder = tmp_path / "local_dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    texts = _prompts(tmp_path, monkeypatch, {"dataset": str(folder), "split": "train"})
    assert texts == ("one", "two")
    with pytest.raises(SurgeryConfigError, match=r"^surgery.tasks\[0\].calibration.dataset: "):
        _prompts(tmp_path, monkeypatch, {"dataset": str(folder), "split": "validation"})


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
