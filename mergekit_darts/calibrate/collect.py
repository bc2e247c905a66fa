"""Collect every task's captures: from the store when it has them, else from the model.

Resource contract (DESIGN.md): one full model in memory at a time, one load per distinct model.
Targets come first, one at a time, because a target may first extend its prompts with its own
greedy completion; tasks sharing a target share its load, and tasks sharing a token sequence set
share its capture. Then the merged model runs over every task's sequences. A model is loaded only
when at least one of its captures (or completions) is missing from the store: K tasks naming T
distinct targets cost T + 1 loads, and a warm store loads none.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from mergekit_darts.calibrate.capture import Captured, NonFiniteCapture, capture
from mergekit_darts.calibrate.continuation import completion_mask, continue_prompts, eos_token_ids
from mergekit_darts.calibrate.runtime import LazyModel, Runtime, stage, timer
from mergekit_darts.calibrate.store import (
    CAPTURES,
    COMPLETIONS,
    CaptureStore,
    entry_key,
    sequences_sha256,
)
from mergekit_darts.config import ResolvedTask
from mergekit_darts.correction.head import OutputHead
from mergekit_darts.correction.losses import LOGIT_LOSSES
from mergekit_darts.errors import HeadError, SurgeryRunError
from mergekit_darts.folder.identity import cache_key


@dataclass
class Calibration:
    """What one task needs captured, and (after the capture functions) what it got."""

    name: str
    target_path: str  # located: a local folder or a Hub id
    prompt_ids: list[list[int]]
    continuation_tokens: int
    batch_size: int
    with_head: bool
    sequences: list[list[int]] = field(default_factory=list)
    completions: list[list[int]] | None = None
    completion_mask: torch.Tensor | None = None
    target: Captured | None = None
    merged: Captured | None = None
    head_need: str | None = None  # what needs the model's own logits (checked on batch one)
    timings: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, task: ResolvedTask, prompt_ids: list[list[int]], target: str) -> Calibration:
        return cls(
            name=task.name,
            target_path=target,
            prompt_ids=prompt_ids,
            continuation_tokens=task.calibration.continuation_tokens,
            batch_size=task.batch_size,
            with_head=task.needs_head,
            head_need=logits_need(task),
        )


def logits_need(task: ResolvedTask) -> str | None:
    """What of ``task`` needs the model's own logits ("loss kl", "select metric agreement")."""
    if not task.needs_logits:
        return None
    losses = sorted({c.loss for c in task.candidates()} & set(LOGIT_LOSSES))
    return f"loss {losses[0]}" if losses else f"select metric {task.select.metric}"


def group_by_target(calibrations: list[Calibration]) -> dict[str, list[Calibration]]:
    """Tasks by target location, in the order the block first names each target."""
    groups: dict[str, list[Calibration]] = {}
    for cal in calibrations:
        groups.setdefault(cal.target_path, []).append(cal)
    return groups


def capture_target(
    store: CaptureStore, target: str, group: list[Calibration], runtime: Runtime
) -> None:
    """Completions, then hidden states with entropy, of every task whose target is ``target``."""
    identity = cache_key(target)
    model = LazyModel(target, f"target {target}", runtime, store.stats)
    try:
        for cal in group:
            cal.sequences = cal.prompt_ids
            if cal.continuation_tokens:
                _continue(store, identity, model, cal, runtime)
        # entropy always: the target computes its logits anyway, and the report plots it
        _capture_all(store, identity, model, group, runtime, "target", with_entropy=True)
    finally:
        model.close()


def capture_merged(
    store: CaptureStore, merged: str, calibrations: list[Calibration], runtime: Runtime
) -> None:
    """The merged model's hidden states on every task's sequences (its logits are never needed)."""
    model = LazyModel(merged, f"the merged model {merged}", runtime, store.stats)
    try:
        identity = cache_key(merged)
        _capture_all(store, identity, model, calibrations, runtime, "merged", with_entropy=False)
    finally:
        model.close()


def _continue(
    store: CaptureStore, identity: str, model: LazyModel, cal: Calibration, runtime: Runtime
) -> None:
    """Extend the prompts with the target's greedy completions (stored like captures)."""
    key = entry_key(
        COMPLETIONS,
        model=identity,
        prompts=sequences_sha256(cal.prompt_ids),
        max_new_tokens=cal.continuation_tokens,
        tokenizer_eos=runtime.tokenizer.eos_token_id,
        pad_id=runtime.pad_id,
        batch_size=cal.batch_size,
        device=runtime.device,
        device_map=runtime.device_map,
    )
    n = len(cal.prompt_ids)
    completions = store.get_completions(key, n, cal.continuation_tokens, model=identity)
    if completions is None:
        loaded = model.get(cal.name, cal.timings, "load_target_s")
        with (
            stage(cal.name, "generating the target's completions"),
            timer(cal.timings, "generate_s"),
        ):
            completions = continue_prompts(
                loaded,
                cal.prompt_ids,
                max_new_tokens=cal.continuation_tokens,
                eos_ids=eos_token_ids(loaded, runtime.tokenizer),
                pad_id=runtime.pad_id,
                batch_size=cal.batch_size,
                progress=runtime.progress,
                desc=f"{cal.name}: generate",
            ).completions
        store.stats.computed += 1
        store.put_completions(key, completions, model=identity)
    cal.completions = completions
    cal.sequences = [list(p) + c for p, c in zip(cal.prompt_ids, completions, strict=True)]
    cal.completion_mask = completion_mask(
        [len(p) for p in cal.prompt_ids], [len(c) for c in completions]
    )


def _capture_all(
    store: CaptureStore,
    identity: str,
    model: LazyModel,
    calibrations: list[Calibration],
    runtime: Runtime,
    role: str,
    *,
    with_entropy: bool,
) -> None:
    """One capture per distinct (sequences, batch size), with what any of its tasks needs.

    Every capture of this model shares one :class:`OutputHead` (one float32 copy of the LM head
    per model, not per capture). A task that needs the model's own logits has the head checked on
    the first batch of the first capture (or when a stored entry is read), before the rest.
    """
    keys, needs, requires = _capture_keys(identity, calibrations, runtime, with_entropy)
    done: dict[str, Captured] = {}
    shared: OutputHead | None = None
    for cal in calibrations:
        key = keys[id(cal)]
        if key not in done:
            lengths = [len(s) for s in cal.sequences]
            owner, need = requires.get(key, (cal.name, None))
            found = store.get(
                key, lengths, runtime.cache_dtype, runtime.device, needs[key], model=identity
            )
            if found is not None and need is not None:
                with _head_or_stop(owner):
                    found.head.require(need)
            if found is None:
                found = _compute(model, cal, runtime, role, needs[key], shared, (owner, need))
                store.stats.computed += 1
                store.put(key, found, model=identity)
            if found.head is not None:
                if shared is None:
                    shared = found.head
                elif found.head is not shared and _same_head(found.head, shared):
                    found.head = shared  # entries read from disk: one copy per model here too
            done[key] = found
        view = _view(done[key], with_entropy, cal.with_head)
        if role == "target":
            cal.target = view
        else:
            cal.merged = view


def _capture_keys(
    identity: str, calibrations: list[Calibration], runtime: Runtime, with_entropy: bool
) -> tuple[dict[int, str], dict[str, tuple[bool, bool]], dict[str, tuple[str, str]]]:
    """Each calibration's store key (by ``id``: names may repeat, a task's held-out completions
    are its own), what each key's capture must record (entropy, head), and which task first
    needs its head to reproduce the logits (key -> (task, what needs them))."""
    keys: dict[int, str] = {}
    needs: dict[str, tuple[bool, bool]] = {}
    requires: dict[str, tuple[str, str]] = {}
    for cal in calibrations:
        key = entry_key(
            CAPTURES,
            model=identity,
            sequences=sequences_sha256(cal.sequences),
            cache_dtype=str(runtime.cache_dtype),
            batch_size=cal.batch_size,
            device=runtime.device,
            device_map=runtime.device_map,
        )
        keys[id(cal)] = key
        entropy, head = needs.get(key, (False, False))
        needs[key] = (entropy or with_entropy, head or cal.with_head)
        if cal.head_need is not None:
            requires.setdefault(key, (cal.name, cal.head_need))
    return keys, needs, requires


def _compute(
    model: LazyModel,
    cal: Calibration,
    runtime: Runtime,
    role: str,
    need: tuple[bool, bool],
    shared: OutputHead | None,
    head_need: tuple[str, str | None],
) -> Captured:
    """``cal``'s capture from the model itself (loaded on first use), with ``need`` (entropy,
    head); ``head_need``: the task whose use of the logits requires a verified head, and what."""
    what = "the target's" if role == "target" else "the merged model's"
    owner, required = head_need
    loaded = model.get(cal.name, cal.timings, f"load_{role}_s")
    with (
        stage(cal.name, f"capturing {what} hidden states"),
        timer(cal.timings, f"capture_{role}_s"),
        _finite_or_stop(cal.name, model.label),
        _head_or_stop(owner),
    ):
        return capture(
            loaded,
            cal.sequences,
            batch_size=cal.batch_size,
            with_entropy=need[0],
            with_head=need[1],
            cache_dtype=runtime.cache_dtype,
            cache_device=runtime.device,
            pad_id=runtime.pad_id,
            desc=f"{cal.name}: {role}",
            progress=runtime.progress,
            shared_head=shared,
            require_head=required,
        )


def _same_head(a: OutputHead, b: OutputHead) -> bool:
    """Whether two heads are one output path (so one copy can stand for both)."""
    same_bias = (a.bias is None) == (b.bias is None) and (
        a.bias is None or torch.equal(a.bias, b.bias)
    )
    settings = (a.scale, a.softcap, a.verified) == (b.scale, b.softcap, b.verified)
    return settings and same_bias and torch.equal(a.weight, b.weight)


@contextmanager
def _head_or_stop(task: str) -> Iterator[None]:
    """An output path that does not reproduce the model's logits: one line naming the task."""
    try:
        yield
    except HeadError as err:
        raise SurgeryRunError(f"surgery task {task!r}: {err}") from None


@contextmanager
def _finite_or_stop(task: str, label: str) -> Iterator[None]:
    """A model that computes NaN or inf stops the run with one line: nothing to train on."""
    try:
        yield
    except NonFiniteCapture as err:
        raise SurgeryRunError(
            f"surgery task {task!r}: {label} computes {err}; the merged model and any existing "
            "surgery/ folder are unchanged"
        ) from None


def _view(captured: Captured, with_entropy: bool, with_head: bool) -> Captured:
    """Exactly the fields asked for (an entry may hold more), sharing the tensors."""
    return Captured(
        hidden=captured.hidden,
        mask=captured.mask,
        entropy=captured.entropy if with_entropy else None,
        head=captured.head if with_head else None,
    )
