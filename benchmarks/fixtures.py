"""Benchmark inputs built locally: random Llama pairs, a word-level tokenizer, calibration text.

Nothing is downloaded. A "pair" is a random merged model and a target that is the same model
plus seeded noise on every weight, so the surgery has something real to correct; both share one
tokenizer whose vocabulary has exactly ``vocab`` entries (V = 32000 by default, like Llama-2), so
the LM head and the entropy computation cost what they cost at scale. Prompts are random token
ids written out as text: with the word-level tokenizer each word is one token, so the token
lengths are exactly what was asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]
PAD, BOS, EOS = 0, 2, 3
Settings = TypeVar("Settings")


def from_options(cls: type[Settings], options: argparse.Namespace, **derived: Any) -> Settings:
    """The dataclass ``cls`` from a parsed command line, in one construction: each field from the
    option of its name, ``derived`` for the fields computed from options; the rest keep their
    defaults. A field and its option share their name, so nothing is relayed by hand."""
    given = {f.name: getattr(options, f.name) for f in dataclasses.fields(cls) if f.name in options}
    return cls(**(given | derived))


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a random Llama; defaults are sized for a 2-core CPU."""

    hidden: int = 512
    layers: int = 2
    vocab: int = 32000
    intermediate: int | None = None  # default: Llama-2's 11008/4096 ratio, rounded to 64
    heads: int | None = None  # default: head dim 64 (128 from H = 4096 up, like Llama-2)
    dtype: str = "float32"

    def resolved(self) -> dict[str, int]:
        inter = self.intermediate or max(64, round(self.hidden * 11008 / 4096 / 64) * 64)
        head_dim = 128 if self.hidden >= 4096 else 64
        heads = self.heads or max(1, self.hidden // head_dim)
        return {"intermediate": inter, "heads": heads}

    def tag(self) -> str:
        return f"h{self.hidden}-l{self.layers}-v{self.vocab}-{self.dtype}"


@dataclass(frozen=True)
class Pair:
    """A merged model folder and its target folder (each with the tokenizer)."""

    merged: str
    target: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def build_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer with ``vocab`` entries: specials, then ``w4 ... w{vocab-1}``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = {tok: i for i, tok in enumerate(SPECIAL)}
    words.update({f"w{i}": i for i in range(len(SPECIAL), vocab)})
    core = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", BOS)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )


def llama_config(spec: ModelSpec, max_positions: int = 4096) -> Any:
    from transformers import LlamaConfig

    shape = spec.resolved()
    return LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=shape["intermediate"],
        num_hidden_layers=spec.layers,
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["heads"],
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )


def build_pair(root: str | Path, spec: ModelSpec, seed: int = 0, noise: float = 0.3) -> Pair:
    """Save a random merged model and a noisy target under ``root/<spec tag>`` (reused if there)."""
    import torch
    from transformers import LlamaForCausalLM

    folder = Path(root) / spec.tag()
    pair = Pair(str(folder / "merged"), str(folder / "target"))
    if all((Path(p) / "config.json").is_file() for p in (pair.merged, pair.target)):
        return pair
    tokenizer = build_tokenizer(spec.vocab)
    dtype = getattr(torch, spec.dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(llama_config(spec)).to(dtype).eval()
        model.save_pretrained(pair.merged)
        tokenizer.save_pretrained(pair.merged)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(noise * p.float().std().to(dtype) * torch.randn_like(p))
        model.save_pretrained(pair.target)
        tokenizer.save_pretrained(pair.target)
    del model
    return pair


def random_texts(
    tokenizer: Any, count: int, min_tokens: int, max_tokens: int, seed: int
) -> list[str]:
    """Texts of random ordinary tokens, ``min_tokens..max_tokens`` of them each."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    low = max(special, default=0) + 1
    high = len(tokenizer) - 1
    texts = []
    for _ in range(count):
        length = rng.randint(min_tokens, max_tokens)
        ids = [rng.randint(low, high) for _ in range(length)]
        texts.append(tokenizer.decode(ids))
    return texts


def calibration_texts(tokenizer: Any, n: int, max_length: int, seed: int = 0) -> list[str]:
    """``n`` prompts of ``max_length/2 .. max_length-1`` tokens (BOS makes the last one)."""
    return random_texts(tokenizer, n, max(1, max_length // 2), max(1, max_length - 1), seed)


def write_jsonl(path: str | Path, texts: list[str]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def model_file_bytes(folder: str | Path) -> int:
    """Bytes of a model's weights on disk (safetensors shards): what loading puts in memory."""
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def shadow_model(source: str, folder: Path) -> str:
    """A folder of symlinks to ``source``'s files, so ``surgery/`` is written there, not in the
    user's checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    for item in Path(source).resolve().iterdir():
        link = folder / item.name
        if item.is_file() and not link.exists():
            link.symlink_to(item)
    return str(folder)
