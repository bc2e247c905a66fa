"""Tiny real models for tests: a word-level tokenizer and random Llama checkpoints, built locally.

Experts are the base plus seeded noise on every weight, so a mergekit merge of them really
differs from each expert (the surgery has something to correct) while all share one tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mergekit_darts.artifacts import write_surgery_folder
from mergekit_darts.core.modules import SurgeryModule, build_module
from mergekit_darts.core.router import Router

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
    modules = {
        name: random_module(kind, hidden_size, rank, max_positions, seed=seed + i, scale=scale)
        for i, (name, kind) in enumerate(kinds.items(), start=1)
    }
    router = random_router(hidden_size, list(kinds), background, seed=seed)
    tasks = {
        name: {"module": kind, "rank": rank, "max_positions": max_positions}
        for name, kind in kinds.items()
    }
    manifest = {
        "hidden_size": hidden_size,
        "tasks": tasks,
        "router": {"tasks": list(kinds), "background": background},
    }
    write_surgery_folder(folder, modules, manifest, router=router)
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
