"""The real families (`make demo-real`, `--scale long`): SmolLM2-135M-Instruct and three experts
fine-tuned from it.

The base is the real checkpoint (demo.smollm2). Each expert fine-tunes only the
top `trainable_layers` decoder layers and the final norm on one domain of
demo.real_domains (answers of a few tokens) or demo.long_domains (about 50 tokens), the loss on
the answer and the end-of-turn token only; the tied embeddings/head stay frozen. Everything below
those layers is frozen too, so their output for each training item is computed once and cached: a
step then costs the top layers only. That is
what makes three experts of a 135M model a few CPU minutes; the task vectors live in the top
layers, which is where a merge of them has something to carry.

Prompts go through the model's own chat template with an empty system turn (the default system
prompt doubles every prompt's length and teaches nothing here), in training, calibration and
lm-eval alike (the eval files hold the templated prompt). The same driver
(demo.run) merges, calibrates and evaluates it as it does the tiny family;
`FamilyPaths` is the shared interface.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import random
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaModel,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    get_cosine_schedule_with_warmup,
)

from demo.domains import DOMAIN_NAMES, Example, Generator, Splits, held_out_items
from demo.family_io import (
    FamilyPaths,
    build_environment,
    collate,
    family_paths,
    is_complete,
    optimizer_step,
    save_model,
    train_experts,
    write_data,
    write_stamp,
    write_tasks,
)
from demo.long_domains import LONG_DOMAINS
from demo.pinning import PINS
from demo.real_domains import REAL_DOMAINS
from demo.smollm2 import WEIGHTS_SHA256, smollm2_folder
from mergekit_darts.overlap import CalibrationGrams

END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class RealRecipe:
    """How each expert is fine-tuned from the pretrained model."""

    trainable_layers: int = 4  # the top ones, plus the final norm
    train_items: int = 192  # distinct training items per domain (their inputs are cached)
    steps: int = 60
    batch: int = 16
    lr: float = 3e-4
    warmup_fraction: float = 0.1
    n_calib: int = 50
    n_eval: int = 50  # evaluation items per domain


@dataclass(frozen=True)
class RealScale:
    """One family built from SmolLM2 (`--scale real` or `long`): its domains, recipe and the
    evaluation's generation length; the same build path serves all of them."""

    version: int | str  # part of the build's identity: change it when the items change (each
    # scale's own values, so two scales never share an identity)
    domains: Mapping[str, Generator]
    recipe: RealRecipe
    max_gen_toks: int  # the evaluation's generation limit: the longest answer, with room


SCALES = {  # the `--scale` value: also the stamp's `scale` and the training items' seed prefix
    # the answers are a few tokens; a chatty model is cut at 16
    "real": RealScale(1, REAL_DOMAINS, RealRecipe(), 16),
    # the longest answer and its end-of-turn are 66 tokens (demo.long_domains)
    "long": RealScale("long-2", LONG_DOMAINS, RealRecipe(), 80),
}


def build_real_family(
    root: Path,
    seed: int = 0,
    progress: bool = True,
    recipe: RealRecipe | None = None,
    scale: str = "real",
) -> FamilyPaths:
    """Fine-tune (or reuse, when `root` holds a complete build of the same recipe) the experts
    of `scale` (a key of SCALES); the base folder is the converted checkpoint itself."""
    spec = SCALES[scale]
    recipe = recipe or spec.recipe
    base = smollm2_folder()
    paths = replace(family_paths(Path(root).resolve()), base=base)
    ident = {"version": spec.version, "seed": seed, "recipe": asdict(recipe)}
    ident.update(base_weights=WEIGHTS_SHA256, pins=PINS)  # the pins decide the weights' bits
    recipe_hash = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()
    if is_complete(paths, recipe_hash):
        write_tasks(paths, END_OF_TURN, spec.max_gen_toks)
        return paths
    paths.stamp.unlink(missing_ok=True)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base)
    raw = {d: disjoint_splits(tokenizer, d, seed, recipe, spec.domains) for d in DOMAIN_NAMES}
    write_data(paths, {d: _templated(tokenizer, s) for d, s in raw.items()})
    write_tasks(paths, END_OF_TURN, spec.max_gen_toks)
    held_out = {d: s.held_out() for d, s in raw.items()}
    train = partial(_train_expert, paths, recipe, seed, scale)
    losses = train_experts(paths, train, held_out, progress)
    seconds = time.perf_counter() - start
    write_stamp(paths, recipe, seed, scale, recipe_hash, losses, seconds)
    return paths


def _train_expert(
    paths: FamilyPaths,
    recipe: RealRecipe,
    seed: int,
    scale: str,
    domain: str,
    held_out: frozenset[str],
    bar: int | None,
) -> float:
    """Fine-tune one expert of `scale` from the pretrained checkpoint and save it; its last loss."""
    base = paths.base
    tokenizer = AutoTokenizer.from_pretrained(base)
    with build_environment(progress=False):
        pretrained = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        rng = random.Random(f"darts-demo-{scale}:{seed}:{domain}")
        items = training_items(rng, domain, recipe.train_items, held_out, SCALES[scale].domains)
        batches = cached_batches(pretrained, tokenizer, items, recipe)
        torch.manual_seed(seed)
        expert, loss = fine_tune_top(pretrained, batches, recipe, domain, bar)
        save_model(expert, tokenizer, paths.experts[domain])
    return loss


def disjoint_splits(
    tokenizer: PreTrainedTokenizerBase,
    domain: str,
    seed: int,
    recipe: RealRecipe,
    generators: Mapping[str, Generator],
) -> Splits:
    """`make_splits`, except that an evaluation item sharing an n-gram with the calibration
    prompts by hf-darts' own leakage rule (CalibrationGrams, on the templated prompts without
    special tokens, as the check sees them) is replaced by the next item of the same stream:
    long prompts of random numbers can share a run of them by chance, and a score on such an
    item is not held out."""
    special = set(tokenizer.all_special_ids)

    def ids(examples: Iterable[Example]) -> list[list[int]]:
        texts = [chat(tokenizer, ex.prompt) for ex in examples]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [[t for t in row if t not in special] for row in encoded]

    items = held_out_items(domain, seed, generators)
    calib = tuple(itertools.islice(items, recipe.n_calib))
    grams = CalibrationGrams(ids(calib))
    held = (ex for ex in items if not grams.found_in(ids([ex])[0]))
    return Splits(calib=calib, eval=tuple(itertools.islice(held, recipe.n_eval)))


def chat(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """One user turn (after an empty system turn) and the generation prompt."""
    turns = [{"role": "system", "content": ""}, {"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)


def _templated(tokenizer: PreTrainedTokenizerBase, splits: Splits) -> Splits:
    def each(examples: tuple[Example, ...]) -> tuple[Example, ...]:
        return tuple(Example(chat(tokenizer, ex.prompt), ex.answer) for ex in examples)

    return Splits(calib=each(splits.calib), eval=each(splits.eval))


def training_items(
    rng: random.Random,
    domain: str,
    count: int,
    held_out: frozenset[str],
    generators: Mapping[str, Generator] = REAL_DOMAINS,
) -> list[Example]:
    """`count` distinct items of `domain`, none of them a calibration or evaluation prompt."""
    items: dict[str, Example] = {}
    while len(items) < count:
        ex = generators[domain](rng)
        if ex.prompt not in held_out:
            items.setdefault(ex.prompt, ex)
    return list(items.values())


Cached = tuple[torch.Tensor, torch.Tensor]  # (input to the top layers, labels), one batch


@torch.no_grad()
def cached_batches(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    items: list[Example],
    recipe: RealRecipe,
) -> list[Cached]:
    """The frozen bottom layers' output for each batch of items, and its answer-only labels."""
    eot = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    seqs = []
    for ex in items:
        prompt = tokenizer(chat(tokenizer, ex.prompt), add_special_tokens=False)["input_ids"]
        answer = tokenizer(ex.answer, add_special_tokens=False)["input_ids"] + [eot]
        seqs.append((prompt + answer, [-100] * len(prompt) + answer))
    first_trained = model.config.num_hidden_layers - recipe.trainable_layers
    cached = []
    for i in range(0, len(seqs), recipe.batch):
        input_ids, labels = collate(seqs[i : i + recipe.batch], tokenizer.pad_token_id)
        hidden = model.model(input_ids, output_hidden_states=True).hidden_states[first_trained]
        cached.append((hidden, labels))
    return cached


def fine_tune_top(
    pretrained: PreTrainedModel,
    batches: list[Cached],
    recipe: RealRecipe,
    name: str,
    bar_line: int | None,
) -> tuple[PreTrainedModel, float]:
    """AdamW with warmup + cosine decay on the top layers and the final norm, fed the cached
    inputs; returns the pretrained model with those layers replaced, and the last step's loss
    (`bar_line`: the terminal line of the step bar, for bars of parallel processes; None: none)."""
    top = top_model(pretrained, recipe.trainable_layers)
    head = pretrained.get_output_embeddings().weight  # tied to the input embeddings: frozen
    optimizer = torch.optim.AdamW(top.parameters(), lr=recipe.lr, weight_decay=0.01)
    warmup = max(1, int(recipe.warmup_fraction * recipe.steps))
    schedule = get_cosine_schedule_with_warmup(optimizer, warmup, recipe.steps)
    top.train()
    loss = torch.tensor(float("nan"))
    bar = tqdm(
        range(recipe.steps),
        desc=f"train {name}",
        disable=bar_line is None,
        leave=False,
        position=bar_line,
    )
    for step in bar:
        hidden, labels = batches[step % len(batches)]
        out = top(inputs_embeds=hidden).last_hidden_state
        targets = labels[:, 1:]
        scored = targets != -100  # the head only where the loss is: answers are a few tokens
        logits = out[:, :-1][scored] @ head.T
        loss = torch.nn.functional.cross_entropy(logits, targets[scored])
        optimizer_step(loss, top.parameters(), optimizer, schedule)
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    expert = copy.deepcopy(pretrained)  # keeps the embeddings tied to the head
    first = pretrained.config.num_hidden_layers - recipe.trainable_layers
    for i, layer in enumerate(top.layers):
        expert.model.layers[first + i].load_state_dict(layer.state_dict())
    expert.model.norm.load_state_dict(top.norm.state_dict())
    return expert.eval(), float(loss.item())


def top_model(pretrained: PreTrainedModel, layers: int) -> LlamaModel:
    """A decoder of the pretrained model's top `layers` and final norm (copies, trainable): fed
    the cached hidden states as `inputs_embeds`, it runs transformers' own masking and RoPE."""
    config = copy.deepcopy(pretrained.config)
    config.num_hidden_layers = layers
    top = LlamaModel(config)
    first = pretrained.config.num_hidden_layers - layers
    for i in range(layers):
        top.layers[i].load_state_dict(pretrained.model.layers[first + i].state_dict())
    top.norm.load_state_dict(pretrained.model.norm.state_dict())
    del top.embed_tokens  # never used: the input is the cached hidden state
    top.embed_tokens = None
    return top.to(torch.float32)
