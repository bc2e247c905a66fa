"""Generation-aware calibration: extend each prompt with the target's own greedy completion.

Prompts alone never show the surgery the positions where an answer is generated; appending what
the target itself would write there gives it those positions, with the target's hidden states as
the reference. Generation runs batch by batch with the KV cache and left padding (the model must
see each prompt's last token last); the sequences handed on are unpadded token lists, which the
capture right-pads, so the completion sits at the same absolute positions it had when generated.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, GenerationConfig

from mergekit_darts.calibrate.capture import input_device
from mergekit_darts.config.schema import default


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into ``input_ids`` and ``attention_mask`` [B, T]."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, width - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, width - len(seq) :] = 1
    return ids, mask


def eos_token_ids(model: nn.Module, tokenizer: object | None = None) -> set[int]:
    """Every id that ends a completion: the model's generation config, its config, the tokenizer."""
    return _eos_of(getattr(model, "generation_config", None), model.config, tokenizer)


def saved_eos_token_ids(folder: str, tokenizer: object, trust_remote_code: bool) -> set[int]:
    """``eos_token_ids`` of a saved model, from its config files (no weights are read)."""
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json
        generation = None
    return _eos_of(generation, config, tokenizer)


def _eos_of(*sources: object) -> set[int]:
    ids: set[int] = set()
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        ids.update([value] if isinstance(value, int) else (value or []))
    return ids


def tokens_sha256(ids: Sequence[int]) -> str:
    """sha256 of token ids written as comma-separated decimals (the manifest's completion hash)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def until_eos(tokens: Iterable[int], eos_ids: set[int]) -> list[int]:
    """The tokens before the first end-of-sequence token (which is not kept)."""
    kept = []
    for token in tokens:
        if token in eos_ids:
            break
        kept.append(token)
    return kept


@torch.inference_mode()
def greedy_completions(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    pad_id: int = 0,
    batch_size: int = default("batch_size"),
    progress: bool = True,
    desc: str = "generate",
) -> list[list[int]]:
    """Each prompt's greedy continuation of up to ``max_new_tokens`` tokens, cut at the first EOS.

    The checkpoint's own generation settings (sampling, repetition penalties) are set aside for
    the call: the completion is the argmax at every step, nothing else.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_completions needs at least one prompt and no empty prompt")
    device = input_device(model)
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    completions: list[list[int]] = []
    try:
        starts = range(0, len(prompts), batch_size)
        for start in tqdm(starts, desc=desc, disable=not progress, leave=False):
            ids, mask = left_pad(prompts[start : start + batch_size], pad_id)
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                eos_token_id=sorted(eos_ids) or None,
                pad_token_id=pad_id,
            )
            completions += [until_eos(row, eos_ids) for row in out[:, ids.shape[1] :].tolist()]
    finally:
        model.generation_config = saved
    return completions


def completion_mask(
    prompt_lengths: Sequence[int], completion_lengths: Sequence[int]
) -> torch.Tensor:
    """[N, T] bool, True exactly at the completion tokens of right-padded prompt+completion rows."""
    width = max(p + c for p, c in zip(prompt_lengths, completion_lengths, strict=True))
    mask = torch.zeros((len(prompt_lengths), width), dtype=torch.bool)
    for row, (p, c) in enumerate(zip(prompt_lengths, completion_lengths, strict=True)):
        mask[row, p : p + c] = True
    return mask


@dataclass(frozen=True)
class Continued:
    """Prompts extended with their completions, ready for ``capture``."""

    sequences: list[list[int]]  # prompt + completion, unpadded
    completions: list[list[int]]
    mask: torch.Tensor  # [N, T] bool, True at completion tokens (right-padded layout)


def continue_prompts(
    model: nn.Module, prompts: Sequence[Sequence[int]], **generate: object
) -> Continued:
    """Append each prompt's greedy completion (``greedy_completions`` keyword arguments)."""
    completions = greedy_completions(model, prompts, **generate)
    return Continued(
        sequences=[list(p) + c for p, c in zip(prompts, completions, strict=True)],
        completions=completions,
        mask=completion_mask([len(p) for p in prompts], [len(c) for c in completions]),
    )
