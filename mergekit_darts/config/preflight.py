"""Checks that open what the block names, run before any merge work starts.

The targets' and the merge's configs (no weights), their tokenizers, the calibration files and
the output folder: each problem is a one-line :class:`SurgeryConfigError` naming the key, so a
7B merge never runs for an hour to fail at a typo. Relative paths resolve from the working
directory, the way mergekit resolves ``model:``, so ``model: ./math`` and ``target: ./math`` name
one folder.

transformers 5 builds ``Qwen2Tokenizer`` (byte-level BPE from vocab + merges) for every
``model_type: qwen2`` folder, whatever ``tokenizer_class`` says, so a folder whose
``tokenizer.json`` holds another model (e.g. word-level) encodes differently from how it was
saved (docs/known-issues.md). :func:`tokenizer_mismatch` detects that while the vocabularies are
compared; the fix is a byte-level BPE tokenizer.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mergekit_darts.config.parse import MIN_PROMPT_TOKENS
from mergekit_darts.config.resolve import ResolvedTask
from mergekit_darts.config.schema import CALIBRATION_SUFFIXES, CalibrationConfig
from mergekit_darts.correction.losses import LOGIT_LOSSES
from mergekit_darts.correction.spec import DEFAULT_RANK, plain_kind_problem
from mergekit_darts.errors import SurgeryConfigError
from mergekit_darts.folder.fs import check_writable
from mergekit_darts.folder.identity import cache_key
from mergekit_darts.folder.manifest import surgery_dir
from mergekit_darts.messages import first_line

log = logging.getLogger("mergekit_darts")
_warned: set[str] = set()  # folders already warned about


def local_or_hub(ref: str, key: str) -> str:
    """An absolute folder path for a local model, or ``ref`` itself for a Hub id."""
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise SurgeryConfigError(f"{key}: {ref} is a file; name the model's folder")
        return str(path.resolve())
    # mergekit's rule (mergekit.card.is_hf): anything else may be a Hub id such as gpt2 or org/name
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise SurgeryConfigError(
            f"{key}: no model folder at {path.resolve()} (relative paths resolve from the "
            f"working directory {os.getcwd()})"
        )
    return ref


def calibration_file(task: ResolvedTask) -> Path | None:
    """The calibration file of a ``path:`` source, checked to exist and have a known suffix."""
    return prompt_file(task.calibration, f"{task.key}.calibration")


def prompt_file(cal: CalibrationConfig, key: str) -> Path | None:
    """The file of a prompt source at ``key`` (a task's calibration, route's background)."""
    key = f"{key}.path"
    if cal.path is None:
        return None
    path = Path(cal.path).expanduser().resolve()
    if path.suffix.lower() not in CALIBRATION_SUFFIXES:
        raise SurgeryConfigError(
            f"{key}: {cal.path} has an unsupported suffix; use one of "
            f"{', '.join(CALIBRATION_SUFFIXES)}"
        )
    if not path.is_file():
        raise SurgeryConfigError(
            f"{key}: no file at {path} (relative paths resolve from the working directory "
            f"{os.getcwd()})"
        )
    if path.stat().st_size == 0:
        raise SurgeryConfigError(f"{key}: {cal.path} is empty; give it at least one prompt")
    return path


@dataclass(frozen=True)
class ModelShape:
    """What surgery needs to know about a model without loading its weights."""

    hidden_size: int | None
    vocab_size: int | None
    not_causal: str | None = None  # why AutoModelForCausalLM cannot load it as a decoder-only LM
    max_positions: int | None = None  # positions it has a table for (None: rotary, unbounded)
    model_type: str | None = None


def model_shape(ref: str, key: str, *, trust_remote_code: bool) -> ModelShape:
    """Hidden and vocabulary size from the model's config.json (no weights are read)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(ref, trust_remote_code=trust_remote_code)
    except Exception as err:  # OSError, ValueError, hub errors: all mean "cannot use it"
        local = "" if Path(ref).exists() else f"; there is no folder {Path(ref).resolve()} either"
        raise SurgeryConfigError(
            f"{key}: cannot read a model config from {ref!r}: {first_line(str(err))}{local}"
        ) from None
    text = config.get_text_config(decoder=True)
    return ModelShape(
        getattr(text, "hidden_size", None),
        getattr(text, "vocab_size", None),
        _not_causal(config),
        _position_limit(text),
        getattr(config, "model_type", None),
    )


def _position_limit(config: Any) -> int | None:
    """The positions a model without rotary positions has a table for (GPT-2's ``n_positions``,
    OPT's learned embeddings, GPT-J's fixed sinusoid table): a longer sequence fails inside the
    model (an index out of range). Rotary models run past ``max_position_embeddings``."""
    limit = getattr(config, "max_position_embeddings", None)
    rotary = getattr(config, "rope_parameters", None) or getattr(config, "alibi", False)
    return limit if isinstance(limit, int) and limit > 0 and not rotary else None


def _not_causal(config: Any) -> str | None:
    """Why calibration (``AutoModelForCausalLM``, one hidden state per input token) cannot run it.

    An encoder-decoder (T5, BART) has no single final hidden state per prompt token that its LM
    head reads, and a model type without a causal-LM class fails to load only after the merge.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        return f"an encoder-decoder model (model_type {config.model_type})"
    remote = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not remote:
        return f"not a causal LM (transformers has no AutoModelForCausalLM for {config.model_type})"
    return None


def check_targets(
    tasks: list[ResolvedTask],
    reference: str,
    reference_label: str,
    *,
    trust_remote_code: bool,
    check_vocab: bool = True,
    target_vocab: str = "exact",
    chat_template_set: bool = False,
    background: CalibrationConfig | None = None,
) -> dict[str, str]:
    """Check each target against ``reference`` (the base before merging, the merge after).

    Returns each task's resolved target location. Both must be decoder-only causal LMs, and no
    task's rank may exceed their hidden size. With ``check_vocab`` (``reference``'s tokenizer is
    the one calibration will use) the vocabularies are compared too (:func:`_check_vocab`):
    calibration feeds one sequence of token ids to both; and ``chat_template: true`` needs a
    chat template in that tokenizer, unless ``chat_template_set`` (the merge sets its own); so
    does route's ``background`` with ``chat_template: true``.
    """
    ref_shape = model_shape(reference, reference_label, trust_remote_code=trust_remote_code)
    if ref_shape.not_causal:
        raise SurgeryConfigError(_not_causal_message(reference_label, ref_shape.not_causal))
    ref_tokenizer = _tokenizer_facts(reference, trust_remote_code) if check_vocab else None
    located = {}
    for task in tasks:
        key = f"{task.key}.target"
        where = local_or_hub(task.target, key)
        shape = model_shape(where, key, trust_remote_code=trust_remote_code)
        if shape.not_causal:
            raise SurgeryConfigError(_not_causal_message(f"{key}: {task.target}", shape.not_causal))
        if shape.hidden_size != ref_shape.hidden_size:
            raise SurgeryConfigError(
                f"{key}: {task.target} has hidden_size {shape.hidden_size}, the {reference_label} "
                f"has {ref_shape.hidden_size}; surgery needs targets of the merged architecture"
            )
        _check_rank(task, ref_shape.hidden_size, reference_label)
        _check_plain(task, ref_shape.model_type)
        for label, limit in ((reference_label, ref_shape), (f"target {task.target}", shape)):
            _check_length(f"{task.key}.calibration", task.calibration, limit, label)
            _check_verdict_length(task, limit, label)
        if check_vocab:
            tokens = _tokenizer_facts(where, trust_remote_code)
            _check_vocab(
                task,
                shape,
                ref_shape,
                tokens and tokens.vocab,
                ref_tokenizer and ref_tokenizer.vocab,
                reference_label,
                target_vocab,
            )
            if task.calibration.chat_template and not chat_template_set:
                key = f"{task.key}.calibration.chat_template"
                _check_chat_template(key, ref_tokenizer, reference_label)
        located[task.name] = where
    if background is not None:
        _check_length("surgery.route.background", background, ref_shape, reference_label)
    if (
        check_vocab
        and background is not None
        and background.chat_template
        and not chat_template_set
    ):
        key = "surgery.route.background.chat_template"
        _check_chat_template(key, ref_tokenizer, reference_label)
    return located


def _not_causal_message(what: str, why: str) -> str:
    return (
        f"{what} is {why}; surgery corrects the final hidden state of a decoder-only causal LM "
        "(one that AutoModelForCausalLM loads), so merge such models without a surgery: block"
    )


def _check_rank(task: ResolvedTask, hidden_size: int | None, reference_label: str) -> None:
    """A low-rank correction of an H-dimensional state needs rank <= H (each candidate's too)."""
    if hidden_size is None:
        return
    written = task.select.candidates if task.select is not None else [None]
    for number, choice in enumerate(written):
        candidate = task if choice is None else task.as_candidate(choice)
        if candidate.rank <= hidden_size or candidate.module == "none":  # none has no rank
            continue
        own = choice is not None and "rank" in choice.model_fields_set
        key = f"{task.select_key}.candidates[{number}].rank" if own else task.source_key("rank")
        raise SurgeryConfigError(
            f"{key}: rank {candidate.rank} exceeds the hidden size {hidden_size} of the "
            f"{reference_label}; a low-rank correction needs rank <= hidden_size "
            f"(default {DEFAULT_RANK})"
        )


def _check_plain(task: ResolvedTask, model_type: str | None) -> None:
    """A plain kind the engines would lose on this architecture is refused before merging (a
    default candidate is left out instead: ``ResolvedTask.candidates``)."""
    written = task.select.candidates if task.select is not None else [None]
    if task.default_candidates:
        written = []
    for number, choice in enumerate(written):
        candidate = task if choice is None else task.as_candidate(choice)
        problem = plain_kind_problem(candidate.module, model_type)
        if problem is None:
            continue
        own = choice is not None and choice.module is not None
        key = f"{task.select_key}.candidates[{number}].module" if own else task.source_key("module")
        raise SurgeryConfigError(f"{key}: {problem}")


def _check_length(key: str, cal: CalibrationConfig, shape: ModelShape, label: str) -> None:
    """Calibration sequences (prompt + completion, at most ``max_length`` tokens) must fit the
    positions a model has: checked before the merge, which would otherwise be written first."""
    if shape.max_positions is not None and cal.max_length > shape.max_positions:
        raise SurgeryConfigError(
            f"{key}.max_length: {cal.max_length} exceeds the {shape.max_positions} positions "
            f"the {label} has (max_position_embeddings, a learned position table); lower "
            f"max_length to {shape.max_positions} or less"
        )


def _check_verdict_length(task: ResolvedTask, shape: ModelShape, label: str) -> None:
    """The verdict runs each prompt (up to ``max_length - continuation_tokens`` tokens) plus the
    target's completion (up to ``completion_tokens``) through both models: a learned position
    table must hold their sum, or generation fails after the merge is written. Refused rather
    than clipped, since clipping would change what the verdict judges."""
    if shape.max_positions is None or not task.verdict:
        return
    cal, limit = task.calibration, shape.max_positions
    prompt, completion = cal.max_length - cal.continuation_tokens, task.select.completion_tokens
    if prompt + completion <= limit:
        return
    key = f"{task.select_key}.completion_tokens"
    fixes = []
    if limit - prompt >= 1:
        fixes.append(f"lower {key} to {limit - prompt}")
    if limit - completion >= MIN_PROMPT_TOKENS:
        fixes.append(f"lower max_length to {limit - completion + cal.continuation_tokens}")
    less = " - continuation_tokens" if cal.continuation_tokens else ""
    if not fixes:
        fixes.append(f"lower max_length{less} + {key} to {limit} or less")
    raise SurgeryConfigError(
        f"{task.key}.calibration.max_length: prompts of up to {prompt} tokens (max_length{less}) "
        f"plus the verdict's target completions of up to {completion} tokens ({key}) exceed the "
        f"{limit} positions the {label} has (max_position_embeddings, a learned position table); "
        f"{', or '.join(fixes)}, or set `select: off`"
    )


def _check_chat_template(key: str, tokenizer: _TokenizerFacts | None, reference_label: str) -> None:
    if tokenizer is not None and tokenizer.chat_template:
        return
    has = "has no chat template" if tokenizer is not None else "has no tokenizer"
    raise SurgeryConfigError(
        f"{key}: the {reference_label} {has}, and calibration "
        "uses the tokenizer it gives the merge; set the merge's `chat_template:` (e.g. chatml) "
        "or remove this key"
    )


def _check_vocab(
    task: ResolvedTask,
    shape: ModelShape,
    ref_shape: ModelShape,
    tokens: dict[str, int] | None,
    ref_vocab: dict[str, int] | None,
    reference_label: str,
    target_vocab: str,
) -> None:
    """The vocabulary rules between a target and the reference.

    The token -> id maps decide (equal, or under ``prefix`` every reference token keeping its id
    in the target); embedding row counts may differ, since rows without a token (mergekit's
    ``tokenizer.pad_to_multiple_of``, appended tokens) never meet a calibration id and the
    hidden-state losses never look at them. ``kl``/``ce`` compare the two heads' distributions
    over one vocabulary, so they need equal row counts as well. Without both tokenizers only the
    row counts can be compared.
    """
    key, target, ref = f"{task.key}.target", task.target, reference_label
    sizes = f"{target} has vocab_size {shape.vocab_size}, the {ref} has {ref_shape.vocab_size}"
    if task.needs_logits and shape.vocab_size != ref_shape.vocab_size:
        losses = sorted({c.loss for c in task.candidates()} & set(LOGIT_LOSSES))
        why = f"loss {'/'.join(losses)}" if losses else f"select metric {task.select.metric}"
        raise SurgeryConfigError(
            f"{key}: {sizes}; {why} compares the two models' distributions over one vocabulary "
            "and needs equal sizes; use loss l1 or ewl1 (and select metric rho_l1), which accept "
            "padded embedding rows and (with surgery.target_vocab: prefix) appended tokens"
        )
    prefix = target_vocab == "prefix" and not task.needs_logits
    if tokens is None or ref_vocab is None:
        if shape.vocab_size == ref_shape.vocab_size or (
            prefix and shape.vocab_size > ref_shape.vocab_size
        ):
            return
        hint = (
            "; a target that only appends tokens is accepted with surgery.target_vocab: prefix"
            if not prefix and shape.vocab_size > ref_shape.vocab_size
            else ""
        )
        raise SurgeryConfigError(
            f"{key}: {sizes}, and without both tokenizers their token ids cannot be compared{hint}"
        )
    shared = {t: tokens.get(t) for t in ref_vocab}
    keeps_ids = shared == ref_vocab
    compared = shared if prefix else tokens
    if compared != ref_vocab:
        differ = len(set(ref_vocab.items()) ^ set(compared.items()))
        hint = (
            "; it keeps every token's id and adds tokens: set surgery.target_vocab: prefix"
            if keeps_ids and not task.needs_logits
            else ""
        )
        raise SurgeryConfigError(
            f"{key}: the tokenizer of {target} ({len(tokens)} tokens, vocab_size "
            f"{shape.vocab_size}) differs from the {ref}'s ({len(ref_vocab)} tokens, vocab_size "
            f"{ref_shape.vocab_size}): {differ} token/id pairs differ; calibration feeds the same "
            f"token ids to both{hint}"
        )
    top = max(ref_vocab.values(), default=-1)
    if shape.vocab_size is not None and top >= shape.vocab_size:
        raise SurgeryConfigError(
            f"{key}: the {ref}'s tokenizer has token ids up to {top}, but {target} has only "
            f"{shape.vocab_size} embedding rows"
        )


@dataclass(frozen=True)
class _TokenizerFacts:
    """What the checks need of a tokenizer: its token -> id map and whether it has a template."""

    vocab: dict[str, int]
    chat_template: bool


def _tokenizer_facts(ref: str, trust_remote_code: bool) -> _TokenizerFacts | None:
    """The folder's tokenizer facts, or None when it has no tokenizer to compare.

    Warns when transformers loads a tokenizer that encodes unlike the folder's tokenizer.json
    (transformers 5 and ``model_type: qwen2``; docs/known-issues.md): the maps may still agree.
    """
    from transformers import AutoTokenizer

    def facts() -> _TokenizerFacts | None:
        try:
            tokenizer = AutoTokenizer.from_pretrained(ref, trust_remote_code=trust_remote_code)
        except Exception:  # no tokenizer files: nothing to compare, the vocab_size check remains
            return None
        warn_tokenizer_mismatch(ref, tokenizer)
        return _TokenizerFacts(
            tokenizer.get_vocab(), bool(getattr(tokenizer, "chat_template", None))
        )

    return by_files(_VOCABS, ref, trust_remote_code, facts)


def tokenizer_mismatch(folder: str | Path, tokenizer: Any) -> str | None:
    """Why ``tokenizer`` (as transformers loaded it) encodes unlike ``folder/tokenizer.json``.

    Probes with text decoded from the file's own vocabulary; None when both agree or the folder
    has no ``tokenizer.json`` to compare with.
    """
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(str(path))
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(min(saved.get_vocab_size(), 256)) if i not in special]
    probe = saved.decode(ids)
    want = saved.encode(probe, add_special_tokens=False).ids
    got = tokenizer(probe, add_special_tokens=False)["input_ids"]
    if got == want:
        return None
    kind = json.loads(path.read_text(encoding="utf-8")).get("model", {}).get("type", "?")
    return (
        f"transformers loads the tokenizer of {folder} as {type(tokenizer).__name__}, which "
        f"encodes unlike its tokenizer.json (a {kind} model); calibration and evaluation use what "
        "transformers loads (for model_type qwen2, transformers 5 always builds Qwen2Tokenizer: "
        "give such models a byte-level BPE tokenizer)"
    )


def warn_tokenizer_mismatch(folder: str | Path, tokenizer: Any) -> None:
    """Log :func:`tokenizer_mismatch` once per folder."""
    key = str(Path(folder).resolve())
    if key not in _warned and (problem := tokenizer_mismatch(folder, tokenizer)):
        _warned.add(key)
        log.warning(problem)


_VOCABS: dict[Any, Any] = {}


def by_files(cache: dict[Any, Any], ref: str, trust_remote_code: bool, make: Any) -> Any:
    """``make()``, cached under ``ref``'s :func:`~mergekit_darts.folder.identity.cache_key`.

    A sweep checks and tokenizes with the same models in every cell: they are read once, and
    again as soon as a file changes.
    """
    key = (cache_key(ref), trust_remote_code)
    if key not in cache:
        if len(cache) >= 16:
            cache.clear()
        cache[key] = make()
    return cache[key]


def check_output(out_path: str | Path, overwrite: bool) -> None:
    """Refuse to replace an existing ``surgery/`` folder unless asked to, a ``surgery/`` that is
    a symbolic link (calibration writes only inside the merged folder) and a merged folder that
    cannot be written to: all before any capture or training."""
    folder = surgery_dir(out_path)
    if folder.is_symlink():
        raise SurgeryConfigError(
            f"{folder} is a symbolic link (to {os.readlink(folder)}): calibration writes "
            "surgery/ only inside the merged folder; remove the link"
        )
    if folder.exists() and not overwrite:
        raise SurgeryConfigError(
            f"{folder} already exists: pass --overwrite-surgery (mergekit-darts merge), "
            "--overwrite (mergekit-darts calibrate), set DARTS_OVERWRITE_SURGERY=1 (mergekit-yaml), "
            "or remove it"
        )
    if Path(out_path).is_dir():
        try:
            check_writable(Path(out_path))
        except OSError as err:
            raise SurgeryConfigError(
                f"cannot write surgery/ into {out_path}: {err.strerror or err}; make the folder "
                "writable or calibrate a copy of it"
            ) from None
