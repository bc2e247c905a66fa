"""What the tests share: tiny real models (a word-level tokenizer and random Llama checkpoints,
built locally), surgery folders of random modules, surgery blocks and merge YAMLs, and the runs of
the real mergekit they go through.

Experts are the base plus seeded noise on every weight, so a mergekit merge of them really
differs from each expert (the surgery has something to correct) while all share one tokenizer.
"""

from __future__ import annotations

import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mergekit.merge
import pytest
import torch
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mergekit_darts.calibrate.data import load_prompts
from mergekit_darts.config import parse_surgery, resolve_tasks
from mergekit_darts.config.schema import DEFAULT_FOLDS
from mergekit_darts.correction.darts_correction import Router, SurgeryModule
from mergekit_darts.correction.modules import build_module
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.folder.artifacts import write_surgery_folder
from mergekit_darts.hosts.mergekit.hook import merge_with_surgery

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]
WORDS = (
    "the a one two three four five six seven eight nine zero plus minus times is = ( ) : , . ? "
    "def return add sub mul x y z n k l question answer repeat reverse last word cat dog red blue "
    "green sun moon tree river stone fire water is not and or if then else for in print"
).split()


def _wrap(core: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around ``core``, with the family's special tokens."""
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(SPECIAL + WORDS))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    return _wrap(core)


def build_bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on the tiny prompts' words.

    For ``model_type: qwen2`` test models: transformers 5 rebuilds every qwen2 tokenizer as
    ``Qwen2Tokenizer`` (byte-level BPE from vocab + merges), which mangles the word-level one.
    """
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator([" ".join(WORDS), *PROMPTS], trainer=trainer)
    return _wrap(core)


def random_module(
    kind: str, hidden_size: int, rank: int, max_positions: int, seed: int, scale: float = 0.3
) -> SurgeryModule:
    """A surgery module with every weight random and non-zero, so the correction is visible
    (weights of standard deviation ``scale``)."""
    module = build_module(kind, hidden_size, rank, max_positions, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(scale * torch.randn(param.shape, generator=generator))
    return module.eval()


def random_router(
    hidden_size: int, tasks: list[str], background: bool, seed: int, scale: float = 1.0
) -> Router:
    """A router with random gate weights, so every class gets a visibly different share."""
    router = Router(hidden_size, tasks, background)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in router.parameters():
            param.copy_(scale * torch.randn(param.shape, generator=generator))
    return router.eval()


def random_modules(
    kinds: dict[str, str],
    hidden_size: int,
    rank: int = 4,
    max_positions: int = 10,
    *,
    seed: int = 0,
    scale: float = 0.3,
) -> dict[str, SurgeryModule]:
    """One random module per task (name -> kind), seeded ``seed + 1``, ``seed + 2``, ... in order."""
    return {
        name: random_module(kind, hidden_size, rank, max_positions, seed=seed + i, scale=scale)
        for i, (name, kind) in enumerate(kinds.items(), start=1)
    }


def write_surgery(
    folder: Path,
    modules: dict[str, SurgeryModule],
    *,
    router: Router | None = None,
    joint: SurgeryModule | None = None,
    entries: dict[str, dict[str, Any]] | None = None,
    **manifest: Any,
) -> Path:
    """``folder`` (a ``surgery/`` folder) holding ``modules`` (name -> module), as the calibration
    writes it: each task's entry states its module's kind, rank and table size plus
    ``entries[name]``; ``router`` (with its manifest entry) and ``joint`` (a joint correction of
    every task) when given; ``manifest`` adds top-level keys (``vocab_size``, ...)."""
    entries = entries or {}
    tasks = {
        name: {
            "module": module.kind,
            "rank": module.rank,
            "max_positions": module.max_positions,
            **entries.get(name, {}),
        }
        for name, module in modules.items()
    }
    hidden_size = next(iter(modules.values())).hidden_size
    content: dict[str, Any] = {"hidden_size": hidden_size, "tasks": tasks, **manifest}
    if router is not None:
        content["router"] = {"tasks": list(router.tasks), "background": router.background}
    if joint is not None:
        sizes = {"rank": joint.rank, "max_positions": joint.max_positions}
        content["joint"] = {"module": joint.kind, **sizes, "tasks": list(modules)}
    return write_surgery_folder(folder, modules, content, router=router, joint=joint)


def write_routed_surgery(
    folder: Path,
    hidden_size: int,
    kinds: dict[str, str],
    *,
    background: bool = True,
    rank: int = 4,
    max_positions: int = 10,
    seed: int = 0,
    scale: float = 0.3,
) -> dict[str, SurgeryModule]:
    """``folder`` (a ``surgery/`` folder) with one random module per task (name -> kind), weights
    of standard deviation ``scale``, and a random router over all of them; returns the modules by
    task name."""
    modules = random_modules(kinds, hidden_size, rank, max_positions, seed=seed, scale=scale)
    router = random_router(hidden_size, list(kinds), background, seed=seed)
    write_surgery(folder, modules, router=router)
    return modules


def tiny_config(vocab_size: int, hidden_size: int = 64, **overrides) -> LlamaConfig:
    settings = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def save_model(
    folder: Path,
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    base: LlamaForCausalLM | None = None,
    noise: float = 0.0,
    **config_overrides,
) -> LlamaForCausalLM:
    """Save a random Llama (``base`` + seeded noise when given) with the tokenizer into ``folder``."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(len(tokenizer), **config_overrides))
    if base is not None:
        model.load_state_dict(base.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * p.std() * torch.randn_like(p))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model.eval()


PROMPTS = [
    "question : two plus three is",
    "def add ( x , y ) : return",
    "repeat the word cat cat cat",
    "reverse red blue green",
    "the sun and the moon",
    "one two three four five six seven",
    "if x is not y then print x else print y",
    "last word of the river is",
    "for n in x : print n",
    "water and fire and stone and tree",
    "question : nine minus four is",
    "def mul ( k , l ) : return k times l",
]


def routed_merge_recipe(
    base: Path,
    root: Path,
    kinds: dict[str, str],
    calibration: dict[str, Any],
    **surgery: Any,
) -> dict[str, Any]:
    """The merge YAML (as a dict) of a routed test family under ``root``: the experts
    ``root/<name>`` merged with ``base`` by task arithmetic (weight 0.5 each) with one surgery
    block, one task per expert (name -> module kind) calibrated on ``root/<name>.jsonl``, routed
    with background ``root/general.jsonl``; ``surgery`` adds training settings."""
    return {
        "merge_method": "task_arithmetic",
        "base_model": str(base),
        "models": [{"model": str(root / name), "parameters": {"weight": 0.5}} for name in kinds],
        "dtype": "float32",
        "surgery": {
            **surgery,
            "route": {
                "holdout": 0.25,
                "background": {"path": str(root / "general.jsonl"), **calibration},
            },
            "tasks": [
                {
                    "name": name,
                    "target": str(root / name),
                    "module": kind,
                    "calibration": {"path": str(root / f"{name}.jsonl"), **calibration},
                }
                for name, kind in kinds.items()
            ],
        },
    }


# ---- surgery blocks and merges ---------------------------------------------------------------------

BIN = Path(sys.executable).parent  # the console scripts of the environment running the tests


def surgery_task(
    name: str,
    target: str | Path,
    prompts: str | Path,
    /,
    *,
    field: str | None = "question",
    calibration: dict[str, Any] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """One task of a surgery block: ``name`` calibrated toward ``target`` on the JSONL (or text)
    file ``prompts``, read from ``field`` (none: the file's default); ``calibration`` adds
    calibration keys, ``settings`` task keys (which may replace ``name`` or ``target``)."""
    source: dict[str, Any] = {"path": str(prompts)}
    if field is not None:
        source["field"] = field
    entry = {"name": name, "target": str(target), "calibration": source | (calibration or {})}
    return entry | settings


def surgery_block(
    target: str | Path,
    prompts: str | Path,
    /,
    *,
    name: str = "math",
    field: str | None = "question",
    calibration: dict[str, Any] | None = None,
    task: dict[str, Any] | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """A one-task surgery block (``surgery_task`` with ``task`` as its task keys) with the block
    keys ``settings``."""
    entry = surgery_task(name, target, prompts, field=field, calibration=calibration, **task or {})
    return {**settings, "tasks": [entry]}


def quick_block(family: Any, data: Path, **settings: Any) -> dict[str, Any]:
    """Task math of ``family`` on the 12 prompts of ``data/math.jsonl`` (24 tokens at most), 15
    steps of batches of 4, float32 captures: a selection run in seconds; ``settings`` are block
    keys."""
    return surgery_block(
        family.math,
        data / "math.jsonl",
        calibration={"max_length": 24},
        steps=15,
        batch_size=4,
        max_positions=64,
        cache_dtype="float32",
        **settings,
    )


def one_task_block(family: Any, data: Path) -> dict[str, Any]:
    """A quick block: task math of ``family``, one prompt of ``data/math.jsonl`` per default
    fold, two steps."""
    return surgery_block(
        family.math,
        data / "math.jsonl",
        calibration={"num_samples": DEFAULT_FOLDS, "max_length": 16},
        steps=2,
        batch_size=4,
    )


def merge_family(family: Any, out: Path, math_weight: float = 0.5) -> Path:
    """A task-arithmetic merge of ``family`` (``base``, ``math``, ``code`` folders) into ``out`` by
    the real, unwrapped mergekit (no surgery step)."""
    config = MergeConfiguration.model_validate(
        {
            "merge_method": "task_arithmetic",
            "base_model": str(family.base),
            "models": [
                {"model": str(family.math), "parameters": {"weight": math_weight}},
                {"model": str(family.code), "parameters": {"weight": 0.5}},
            ],
            "dtype": "float32",
        }
    )
    inspect.unwrap(mergekit.merge.run_merge)(config, str(out), MergeOptions(quiet=True))
    return out


def merge_config(family: Any, data: Path) -> dict[str, Any]:
    """A valid merge YAML (as a dict) of ``family`` with a two-task surgery block over the
    calibration files in ``data``."""
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
                surgery_task("math", family.math, data / "math.jsonl"),
                surgery_task(
                    "code",
                    family.code,
                    data / "code.jsonl",
                    field=None,
                    calibration={"template": "{question}"},
                ),
            ],
        },
    }


def hooked_merge(config: dict[str, Any], out: Path, **kwargs: Any) -> None:
    """``merge_with_surgery`` (the hook's wrapper) around the real, unwrapped ``run_merge``, on the
    merge YAML ``config`` (as a dict)."""
    merge_with_surgery(
        inspect.unwrap(mergekit.merge.run_merge),
        MergeConfiguration.model_validate(config),
        str(out),
        MergeOptions(quiet=True),
        yaml.safe_dump(config, sort_keys=False),
        **kwargs,
    )


def merge(config: dict[str, Any], out: Path) -> dict[str, Any]:
    """Run the hook's merge path (real mergekit, then the surgery); returns the manifest."""
    hooked_merge(config, out)
    return json.loads((out / "surgery" / "manifest.json").read_text())


def refuse(config: dict[str, Any], out: Path) -> str:
    """Run the hook's merge path with the real mergekit; it must fail before writing anything."""
    before = sorted(p.name for p in out.iterdir()) if out.exists() else None
    with pytest.raises(SurgeryConfigError) as info:
        merge(config, out)
    after = sorted(p.name for p in out.iterdir()) if out.exists() else None
    assert after == before, "a refused surgery block must leave the output folder untouched"
    message = str(info.value)
    assert "\n" not in message
    return message


def change_task(index: int, **changes: Any) -> Callable[[dict, Path], None]:
    """A change to ``merge_config``'s task ``index`` (callable values get the odd-files folder;
    ``None`` removes a key, ``calibration`` updates the calibration)."""

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


def change_block(**changes: Any) -> Callable[[dict, Path], None]:
    """A change to ``merge_config``'s surgery block keys."""

    def mutate(config: dict, odd: Path) -> None:
        config["surgery"].update(changes)

    return mutate


def task_prompts(
    folder: Path, monkeypatch: pytest.MonkeyPatch, calibration: dict[str, Any]
) -> tuple[str, ...]:
    """The prompts one task with ``calibration`` reads, relative paths resolved from ``folder``."""
    monkeypatch.chdir(folder)  # relative paths resolve from the working directory
    config = parse_surgery({"tasks": [{"name": "t", "target": "./t", "calibration": calibration}]})
    return load_prompts(resolve_tasks(config)[0]).texts


# ---- a user's folder: ./base ./math ./code ./data, merge YAMLs with relative paths ---------------


def _weighted(**extra: Any) -> dict[str, Any]:
    return {
        "base_model": "./base",
        "models": [
            {"model": "./math", "parameters": {"weight": 0.5, **extra}},
            {"model": "./code", "parameters": {"weight": 0.5, **extra}},
        ],
    }


METHODS = {
    "linear": {"models": _weighted()["models"]},
    "task_arithmetic": _weighted(),
    "ties": _weighted(density=0.5),
    "dare_ties": _weighted(density=0.5),
    "dare_linear": _weighted(density=0.5),
    "breadcrumbs": _weighted(density=0.8, gamma=0.05),
    "della": _weighted(density=0.5, epsilon=0.1),
    "slerp": {
        "base_model": "./math",
        "models": [{"model": "./math"}, {"model": "./code"}],
        "parameters": {"t": 0.5},
    },
}

SURGERY = {  # as a user writes it: relative paths, keys in YAML order
    "steps": 20,
    "batch_size": 4,
    "select": "off",  # the paper's recipe: every task trains its module (the default may keep none)
    "tasks": [
        {
            "name": "math",
            "target": "./math",
            "eval_tasks": ["tiny_math"],
            "calibration": {
                "path": "data/math.jsonl",
                "field": "question",
                "num_samples": 6,
                "max_length": 24,
            },
        },
        {
            "name": "code",
            "target": "./code",
            "loss": "l1",
            "calibration": {
                "path": "data/code.jsonl",
                "template": "{question}",
                "num_samples": 6,
                "max_length": 24,
                "continuation_tokens": 4,
            },
        },
    ],
}
ONE_TASK = {**SURGERY, "steps": 2, "tasks": SURGERY["tasks"][:1]}


def merge_recipe(method: str, surgery: dict[str, Any] | None = SURGERY) -> dict[str, Any]:
    """The merge YAML (as a dict) of ``method`` over a ``workdir``, with ``surgery`` as its block."""
    config = {"merge_method": method, **METHODS[method], "dtype": "float32"}
    if surgery is not None:
        config["surgery"] = surgery
    return config


def merge_yaml(method: str, surgery: dict[str, Any] | None = SURGERY) -> str:
    return yaml.safe_dump(merge_recipe(method, surgery), sort_keys=False)


def script_env(**changes: str) -> dict[str, str]:
    """The environment for a console script run by a test: the hook on, offline, one thread."""
    # One thread per process: two subprocesses share two cores, and torch's default of one
    # thread per core makes tiny models orders of magnitude slower under contention.
    base = {k: v for k, v in os.environ.items() if k != "DARTS_NO_HOOK"}
    return base | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"} | changes


# ---- lm-eval tasks for sweeps ------------------------------------------------------------------------

EVAL_TASKS = ["sweep_a", "sweep_b"]
CHOICE_ITEMS = [
    ("question : two plus three is", ["five", "six", "seven"]),
    ("repeat the word cat", ["cat", "dog", "red"]),
    ("reverse red blue", ["blue red", "red blue", "green"]),
    ("def add ( x , y ) : return", ["x plus y", "x minus y", "x times y"]),
    ("question : nine minus four is", ["five", "four", "nine"]),
]


def write_choice_tasks(folder: Path) -> None:
    """Two offline multiple-choice lm-eval tasks (``EVAL_TASKS``) over one local jsonl (absolute
    path) in the new folder ``folder``."""
    folder.mkdir()
    data = folder / "items.jsonl"
    data.write_text(
        "".join(json.dumps({"q": q, "choices": c, "answer": 0}) + "\n" for q, c in CHOICE_ITEMS)
    )
    for name in EVAL_TASKS:
        config = {
            "task": name,
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test",
            "output_type": "multiple_choice",
            "doc_to_text": "{{q}}",
            "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0},
        }
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(config))
