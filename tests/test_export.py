"""``mergekit-darts export``: the exported folder under plain transformers, on tiny local models.

The surgery folders are written directly (random, non-zero weights in every parameter, position
rows included), so these tests do not depend on the calibration pipeline. The exported model is
checked against ``apply_surgery`` on the merged folder and against an independent float64
computation of the correction (``reference.py``). The shipped file is also the single source of the
position rule and of the ``darts`` section's check: both are tested here against hand-written
references and under transformers' ``from_pretrained``.
"""

from __future__ import annotations

import ast
import errno
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from click.testing import CliRunner
from reference import (
    BAD_SECTIONS,
    MAX_POSITIONS,
    RANK,
    STEPS,
    corrected64,
    fail,
    head_input,
    load,
    load_offloaded,
    logits_without_darts,
    positions_by_hand,
    snapshot,
    unbind_surgery_file,
)
from safetensors.torch import load_file, save_file
from tiny import random_modules, write_surgery
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import apply_surgery
from mergekit_darts.calibrate.train import positions_of
from mergekit_darts.cli import main
from mergekit_darts.correction import modeling_darts
from mergekit_darts.correction.darts_correction import (
    MODULE_KINDS,
    PLAIN_KINDS,
    call_positions,
    correction_module,
    head_positions,
    token_positions,
)
from mergekit_darts.correction.modeling_darts import darts_section, weights_fingerprint
from mergekit_darts.folder.artifacts import expected_shapes
from mergekit_darts.hosts.deploy.export import MODELING_FILE, SHIPPED_FILES, export

# the kinds with tensors, each exported as a task of its own name ("none" is a reserved task name:
# the none module, and routed exports, are tested in test_export_routed.py; the plain kinds export
# as plain checkpoints, tested in test_plain_export.py)
KINDS = tuple(kind for kind in MODULE_KINDS if kind != "none" and kind not in PLAIN_KINDS)


def write_random_surgery(folder: Path, hidden_size: int, kinds: tuple[str, ...]) -> None:
    """``folder/surgery`` with one task per module kind, every weight random and non-zero."""
    modules = random_modules({kind: kind for kind in kinds}, hidden_size, RANK, MAX_POSITIONS)
    entries = {
        kind: {
            "loss": "ewl1",
            "target": f"./{kind}-expert",
            "eval_tasks": [f"tiny_{kind}"],
            "metrics": {"rho_l1": 0.25 + 0.125 * seed},
        }
        for seed, kind in enumerate(kinds, start=1)
    }
    write_surgery(folder / "surgery", modules, entries=entries)


@pytest.fixture(scope="module")
def merged(tiny_merged: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny task-arithmetic merge with a surgery folder of all four module kinds."""
    folder = Path(shutil.copytree(tiny_merged, tmp_path_factory.mktemp("export") / "merged"))
    write_random_surgery(folder, 64, KINDS)
    return folder


@pytest.fixture(scope="module")
def exported(merged: Path) -> Path:
    """``export --all`` of ``merged``: one folder per module kind."""
    dest = merged.parent / "exported"
    export(merged, dest, all_tasks=True)
    return dest


@pytest.fixture(scope="module")
def batch(tiny_family: Any) -> dict[str, torch.Tensor]:
    """Left-padded prompts of very different lengths; the longest runs past MAX_POSITIONS."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_family.base, padding_side="left")
    prompts = [tiny_family.prompts[6], tiny_family.prompts[4], tiny_family.prompts[2]]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    lengths = encoded["attention_mask"].sum(-1).tolist()
    assert max(lengths) > MAX_POSITIONS + 2 and min(lengths) < MAX_POSITIONS
    return dict(encoded)


def reference_model(merged: Path, task: str, **kwargs: Any) -> Any:
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, **kwargs).eval()
    apply_surgery(model, merged / "surgery", task)
    return model


# ---- numbers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_logits_equal_apply_surgery_and_a_float64_reference(
    kind: str, merged: Path, exported: Path, batch: dict[str, torch.Tensor]
) -> None:
    model = load(exported / kind)
    assert type(model).__name__ == "DartsLlamaForCausalLM"
    with torch.no_grad():
        logits = model(**batch).logits
        last = model(**batch, logits_to_keep=1).logits
        positional = model(batch["input_ids"], batch["attention_mask"]).logits
        expected = reference_model(merged, kind)(**batch).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(last, logits[:, -1:], rtol=0, atol=1e-6)
    assert torch.equal(positional, logits)

    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    h, plain_logits = head_input(plain, batch)
    state = load_file(exported / kind / "darts_surgery.safetensors")
    h_hat = corrected64(kind, state, h, positions_by_hand(batch["attention_mask"]))
    reference = h_hat @ plain.lm_head.weight.double().T
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(logits[real].double(), reference[real], rtol=0, atol=1e-4)
    assert (logits - plain_logits)[real].abs().max() > 0.1  # the correction is really there


@pytest.mark.parametrize("kind", KINDS)
def test_cached_generate_equals_apply_surgery(
    kind: str, merged: Path, exported: Path, batch: dict[str, torch.Tensor], tiny_family: Any
) -> None:
    def generate(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = model.generate(
            **batch,
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        return out.sequences, torch.stack(out.logits, dim=1)

    tokens, logits = generate(load(exported / kind))
    want_tokens, want_logits = generate(reference_model(merged, kind))
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize("split", [True, False], ids=["cpu_and_disk", "disk"])
@pytest.mark.parametrize(
    ("kind", "dtype"),
    [(kind, torch.float32) for kind in KINDS]
    + [(k, torch.bfloat16) for k in ("pos_corr", "parallel")],
)
def test_offloaded_export_equals_the_whole_one(
    kind: str,
    dtype: torch.dtype,
    split: bool,
    exported: Path,
    batch: dict[str, torch.Tensor],
    tmp_path: Path,
) -> None:
    """A model too large for memory loads with its surgery on disk (meta until accelerate's hooks
    bring it in); the correction still runs, in float32 whatever the model's dtype, on the very
    numbers of the export loaded whole."""
    whole = load(exported / kind, dtype=dtype)
    offloaded = load_offloaded(exported / kind, tmp_path, split, dtype=dtype)
    assert all(p.dtype == torch.float32 for p in offloaded.darts_surgery.parameters())
    with torch.no_grad():
        expected = whole(**batch).logits
        got = offloaded(**batch).logits
        last = offloaded(**batch, logits_to_keep=1).logits
    assert got.dtype == dtype and not got.is_meta
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(last, expected[:, -1:], rtol=0, atol=1e-6)
    assert all(p.is_meta for p in offloaded.darts_surgery.parameters())  # offloaded again
    options = dict(max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    assert torch.equal(offloaded.generate(**batch, **options), whole.generate(**batch, **options))


def test_half_precision_keeps_the_surgery_float32(
    exported: Path, batch: dict[str, torch.Tensor]
) -> None:
    full = load(exported / "parallel")
    weights = {k: v.clone() for k, v in full.darts_surgery.state_dict().items()}
    for dtype in (torch.bfloat16, torch.float16):
        loaded = load(exported / "parallel", dtype=dtype)
        assert loaded.lm_head.weight.dtype == dtype and loaded.dtype == dtype
        for name, value in loaded.darts_surgery.state_dict().items():
            assert value.dtype == torch.float32 and torch.equal(value, weights[name]), name
    full.to(torch.bfloat16)
    full.half()
    assert full.lm_head.weight.dtype == torch.float16
    for name, value in full.darts_surgery.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, weights[name]), name
    with torch.no_grad():  # and a half-precision forward call still runs the module in float32
        assert full(**batch).logits.dtype == torch.float16


def test_save_pretrained_round_trip(
    exported: Path, batch: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    model = load(exported / "pos_corr")
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    original = json.loads((exported / "pos_corr" / "config.json").read_text())
    assert config["model_type"] == "darts"
    assert config["architectures"] == ["DartsLlamaForCausalLM"]
    assert config["auto_map"] == original["auto_map"]
    # the saved copy's weight files are its own: the export's record of its linked files stays out
    assert "weights" in original["darts"]
    assert config["darts"] == {k: v for k, v in original["darts"].items() if k != "weights"}
    for name, shipped in SHIPPED_FILES.items():  # the correction it imports travels with it
        assert (tmp_path / "saved" / name).read_bytes() == shipped.read_bytes()
    again = load(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(again(**batch).logits, model(**batch).logits)


def test_from_config_builds_an_identity_surgery(exported: Path) -> None:
    config = AutoConfig.from_pretrained(exported / "pos_corr", trust_remote_code=True)
    assert config.model_type == "darts" and isinstance(config, transformers.LlamaConfig)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    assert type(model).__name__ == "DartsLlamaForCausalLM"
    assert all(not p.any() for p in model.darts_surgery.parameters())


def test_loading_needs_trust_remote_code(exported: Path) -> None:
    for loader in (AutoModelForCausalLM, AutoConfig):
        for trust in ({}, {"trust_remote_code": False}):
            with pytest.raises(ValueError, match=r"trust_remote_code=True"):
                loader.from_pretrained(exported / "standard", **trust)


def test_tokenizer_loads_as_the_merged_one(merged: Path, exported: Path, tiny_family: Any) -> None:
    ours = AutoTokenizer.from_pretrained(exported / "add", trust_remote_code=True)
    theirs = AutoTokenizer.from_pretrained(merged)
    assert ours(tiny_family.prompts)["input_ids"] == theirs(tiny_family.prompts)["input_ids"]


@pytest.mark.slow
def test_loads_where_mergekit_darts_is_not_installed(
    exported: Path, batch: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    folders = [str(exported / kind) for kind in KINDS]
    logits = logits_without_darts(folders, batch, tmp_path)
    for folder in folders:
        with torch.no_grad():
            expected = load(Path(folder))(**batch).logits
        torch.testing.assert_close(logits[folder], expected, rtol=0, atol=1e-6)


def test_shipped_file_imports_only_torch_and_transformers() -> None:
    """Both shipped files: torch, transformers and the standard library, plus (relatively) each
    other, under the names the export gives them."""
    relative: set[str] = set()
    for shipped in SHIPPED_FILES.values():
        tree = ast.parse(shipped.read_text())
        imported = {
            name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0)
            for name in (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
        }
        assert imported - set(sys.stdlib_module_names) <= {"torch", "transformers"}, shipped
        relative |= {
            f"{node.module}.py"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level
        }
    assert relative == set(SHIPPED_FILES) - {MODELING_FILE.name}


@pytest.mark.slow
def test_lm_eval_hf_on_the_export_equals_hf_darts(merged: Path, exported: Path) -> None:
    """The model card's ``lm_eval --model hf ... trust_remote_code=True`` gives hf-darts' answers."""
    import contextlib

    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import lm_eval_darts.model  # noqa: F401  (registers hf-darts)

    tasks_dir = Path(__file__).parent / "lm_eval_tasks"
    manager = TaskManager(include_path=str(tasks_dir), include_defaults=False)

    def responses(model: str, model_args: dict[str, Any]) -> dict[str, list]:
        with contextlib.chdir(tasks_dir):  # the task YAMLs name their data relative to it
            out = simple_evaluate(
                model=model,
                model_args={"device": "cpu", "dtype": "float32", **model_args},
                tasks=["darts_tiny_mc", "darts_tiny_gen"],
                batch_size=4,
                task_manager=manager,
                bootstrap_iters=0,
                log_samples=True,
            )
        return {
            task: [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]
            for task, samples in out["samples"].items()
        }

    ours = responses("hf", {"pretrained": str(exported / "pos_corr"), "trust_remote_code": True})
    theirs = responses("hf-darts", {"pretrained": str(merged), "surgery": "pos_corr"})
    plain = responses("hf", {"pretrained": str(merged)})
    assert ours["darts_tiny_gen"] == theirs["darts_tiny_gen"]

    def loglikelihoods(result: dict[str, list]) -> list[float]:
        return [float(r[0][0]) for doc in result["darts_tiny_mc"] for r in doc]

    assert loglikelihoods(ours) == pytest.approx(loglikelihoods(theirs), abs=1e-5)
    gaps = [abs(a - b) for a, b in zip(loglikelihoods(ours), loglikelihoods(plain), strict=True)]
    assert max(gaps) > 0.1  # and the correction changes them


# ---- the rules the shipped file is the single source of --------------------------------------------


MASKS = {
    "left": torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]]),
    "right": torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]]),
}


@pytest.mark.parametrize("side", list(MASKS))
@pytest.mark.parametrize("dtype", [torch.long, torch.bool])
def test_token_positions_count_real_tokens(side: str, dtype: torch.dtype) -> None:
    mask = MASKS[side].to(dtype)
    expected = positions_by_hand(mask)
    assert positions_of is token_positions  # calibration trains with the rule it ships
    assert torch.equal(token_positions(mask), expected)
    for width in (1, 2, 5):  # decoding after a cached past: the mask covers past + new tokens
        assert torch.equal(token_positions(mask, (3, width)), expected[:, -width:])


def test_token_positions_without_a_mask_come_from_the_cache_length() -> None:
    class Cache:
        def get_seq_length(self) -> int:
            return 7

    for past, width in ((0, 4), (7, 1), (7, 3)):
        by_hand = [[past + t for t in range(width)] for _ in range(2)]
        assert token_positions(None, (2, width), past_length=past).tolist() == by_hand
    ids = torch.zeros(2, 3, dtype=torch.long)
    for key in ("cache", "past_key_values"):  # transformers 5.2x's name, and 5.19's
        assert call_positions({"input_ids": ids, key: Cache()}).tolist() == [[7, 8, 9]] * 2
    assert call_positions({"inputs_embeds": torch.zeros(2, 3, 8)}).tolist() == [[0, 1, 2]] * 2
    given = torch.tensor([[4, 5, 6]])  # the model's own position_ids win over the cache length
    assert (
        call_positions({"input_ids": ids, "position_ids": given, "cache": Cache()}).tolist()
        == [[4, 5, 6]] * 2
    )
    mask = MASKS["left"][:2]  # and a 2-D mask wins over both
    arguments = {"input_ids": ids, "attention_mask": mask, "position_ids": given, "cache": Cache()}
    assert torch.equal(call_positions(arguments), positions_by_hand(mask)[:, -3:])
    assert call_positions({"attention_mask": mask}) is None


def test_head_positions_cut_as_the_model_cuts_its_hidden_states() -> None:
    positions = positions_by_hand(MASKS["left"])
    h = torch.zeros(3, 6, 8)
    assert torch.equal(head_positions(positions, 0, h), positions)
    assert torch.equal(head_positions(positions, 2, h[:, -2:]), positions[:, -2:])
    index = torch.tensor([0, 3, 5])
    assert torch.equal(head_positions(positions, index, h[:, index]), positions[:, index])
    with pytest.raises(RuntimeError, match="not supported") as info:
        head_positions(positions, 2, h)
    assert "\n" not in str(info.value)


def test_shipped_module_has_the_state_dicts_of_mergekit_darts_modules() -> None:
    assert modeling_darts.MODULE_KINDS == MODULE_KINDS
    for kind in MODULE_KINDS:
        module = correction_module(kind, 64, RANK, MAX_POSITIONS)
        shapes = {k: tuple(v.shape) for k, v in sorted(module.state_dict().items())}
        assert shapes == expected_shapes(kind, 64, RANK, MAX_POSITIONS)


@pytest.mark.parametrize("change, message", BAD_SECTIONS)
def test_a_bad_darts_section_fails_under_transformers_as_under_vllm(
    change: dict, message: str, exported: Path, tmp_path: Path
) -> None:
    folder = Path(shutil.copytree(exported / "pos_corr", tmp_path / "bad", symlinks=True))
    config = json.loads((folder / "config.json").read_text())
    config["darts"].update(change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as checked:
        darts_section(config)
    for loader in (AutoModelForCausalLM, AutoConfig):
        with pytest.raises(ValueError) as info:
            loader.from_pretrained(folder, trust_remote_code=True)
        assert str(info.value) == str(checked.value)  # one line, the same as vLLM's


def test_a_section_that_does_not_fit_the_model_is_refused(exported: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(exported / "pos_corr", tmp_path / "bad", symlinks=True))
    config = json.loads((folder / "config.json").read_text())
    config["darts"]["hidden_size"] = 32
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="darts.hidden_size 32 does not match") as info:
        load(folder)
    assert "\n" not in str(info.value)


def without_surgery_tensors(exported: Path, folder: Path, keep_file: bool) -> Path:
    """A copy of the pos_corr export whose weight index no longer lists the surgery tensors."""
    folder = Path(shutil.copytree(exported / "pos_corr", folder, symlinks=True))
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {
        k: v for k, v in index["weight_map"].items() if not k.startswith("darts_surgery.")
    }
    index_file.write_text(json.dumps(index))
    unbind_surgery_file(folder)
    if not keep_file:
        (folder / "darts_surgery.safetensors").unlink()
    return folder


@pytest.mark.parametrize("keep_file", [False, True])
def test_missing_surgery_tensors_are_refused(
    keep_file: bool, exported: Path, tmp_path: Path
) -> None:
    """Not a model with an uninitialised surgery (NaN logits) and transformers' generic report."""
    folder = without_surgery_tensors(exported, tmp_path / "bad", keep_file)
    with pytest.raises(ValueError, match=r"darts_surgery\.\* tensors do not fit") as info:
        load(folder)
    message = str(info.value)
    assert "\n" not in message and "darts_surgery.position_bias" in message
    assert "mergekit-darts export" in message


def test_surgery_tensors_of_another_module_are_refused(exported: Path, tmp_path: Path) -> None:
    """A pos_corr config over a standard module's tensors, and over a misshapen position table."""
    folder = Path(shutil.copytree(exported / "pos_corr", tmp_path / "bad", symlinks=True))
    unbind_surgery_file(folder)
    state = load_file(folder / "darts_surgery.safetensors")
    for tensors, named in (
        ({**state, "darts_surgery.position_embedding": state["darts_surgery.position_bias"].clone()},
         "darts_surgery.position_embedding"),
        ({**state, "darts_surgery.position_bias": torch.zeros(MAX_POSITIONS + 1, 64)},
         "darts_surgery.position_bias"),
    ):  # fmt: skip
        save_file(tensors, folder / "darts_surgery.safetensors", metadata={"format": "pt"})
        index_file = folder / "model.safetensors.index.json"
        index = json.loads(index_file.read_text())
        index["weight_map"] |= dict.fromkeys(tensors, "darts_surgery.safetensors")
        index_file.write_text(json.dumps(index))
        with pytest.raises(ValueError, match="tensors do not fit") as info:
            load(folder)
        assert named in str(info.value) and "\n" not in str(info.value)


def test_threads_sharing_the_model_get_their_own_positions(
    exported: Path, batch: dict[str, torch.Tensor], tiny_family: Any
) -> None:
    """Two threads in forward at once, with different batches and paddings, as each alone.

    A barrier inside the first decoder layer holds each call until the other is inside its
    forward too, so both calls are in flight when either reaches the LM head.
    """
    import copy
    import threading

    model = load(exported / "pos_corr")
    right = AutoTokenizer.from_pretrained(tiny_family.base, padding_side="right")
    other = dict(right(tiny_family.prompts[:2], return_tensors="pt", padding=True))
    assert other["input_ids"].shape != batch["input_ids"].shape
    with torch.no_grad():
        alone = [model(**batch).logits, model(**other).logits]

    barrier = threading.Barrier(2, timeout=60)

    def meet(*_: Any) -> None:
        barrier.wait()

    layer = model.model.layers[0].register_forward_pre_hook(meet)
    results: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def run(which: int, inputs: dict[str, torch.Tensor]) -> None:
        try:
            for _ in range(3):
                with torch.no_grad():
                    results[which].append(model(**inputs).logits)
        except BaseException as err:  # noqa: BLE001  (reported by the main thread)
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i, x)) for i, x in enumerate((batch, other))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    layer.remove()
    assert not errors, errors
    for which in (0, 1):
        for logits in results[which]:
            torch.testing.assert_close(logits, alone[which], rtol=0, atol=1e-6)
    # one persistent hook on the head, whatever the number of calls; a deep copy brings its own
    assert len(model.lm_head._forward_pre_hooks) == 1
    twin = copy.deepcopy(model)
    with torch.no_grad():
        assert torch.equal(twin(**batch).logits, alone[0])
    assert len(twin.lm_head._forward_pre_hooks) == 1


# ---- other architectures: tied embeddings, logit softcapping, sharded weights ----------------------


ARCHITECTURES = {
    "qwen2": dict(tie_word_embeddings=True),
    "gemma2": dict(final_logit_softcapping=3.0, head_dim=16, sliding_window=6),
    "mistral": dict(sliding_window=None),
}


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_other_decoders(model_type: str, tmp_path: Path) -> None:
    config = AutoConfig.for_model(
        model_type,
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        **ARCHITECTURES[model_type],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    merged = tmp_path / model_type
    model.save_pretrained(merged, max_shard_size="60KB")  # sharded: the index path of export
    assert (merged / "model.safetensors.index.json").is_file()
    write_random_surgery(merged, 32, ("parallel",))
    export(merged, tmp_path / "dest", "parallel", link="copy")

    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]])
    inputs = {"input_ids": ids, "attention_mask": (ids != 0).long()}
    exported = load(tmp_path / "dest", attn_implementation="eager")
    reference = reference_model(merged, "parallel", attn_implementation="eager")
    with torch.no_grad():
        logits = exported(**inputs).logits
        torch.testing.assert_close(logits, reference(**inputs).logits, rtol=0, atol=1e-6)
        tokens = exported.generate(**inputs, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
        want = reference.generate(**inputs, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, want)
    plain = AutoModelForCausalLM.from_pretrained(merged, attn_implementation="eager").eval()
    assert (logits - head_input(plain, inputs)[1]).abs().max() > 0.1
    if model_type == "qwen2":
        assert exported.lm_head.weight is exported.model.embed_tokens.weight
    if model_type == "gemma2":  # corrected before the head: the softcap still bounds the logits
        assert logits.abs().max() <= 3.0


# ---- the folder and the command ----------------------------------------------------------------------


def test_all_writes_one_folder_per_task(merged: Path, exported: Path) -> None:
    assert sorted(p.name for p in exported.iterdir()) == sorted(KINDS)
    for kind in KINDS:
        config = json.loads((exported / kind / "config.json").read_text())
        assert config["darts"] == {
            "format": "darts-export",
            "version": 1,
            "base_model_type": "llama",
            "base_architecture": "LlamaForCausalLM",
            "task": kind,
            "module": kind,
            "rank": RANK,
            "max_positions": MAX_POSITIONS,
            "hidden_size": 64,
            "prefix": "darts_surgery.",
            "weights": {
                "darts_surgery.safetensors": weights_fingerprint(
                    exported / kind / "darts_surgery.safetensors"
                ),
                "model-00001-of-00001.safetensors": weights_fingerprint(
                    merged / "model.safetensors"
                ),
            },
        }
        merged_config = json.loads((merged / "config.json").read_text())
        changed = {"model_type", "architectures", "auto_map", "darts"}
        assert {k: v for k, v in config.items() if k not in changed} == {
            k: v for k, v in merged_config.items() if k not in changed
        }
        index = json.loads((exported / kind / "model.safetensors.index.json").read_text())
        surgery = {k for k, v in index["weight_map"].items() if v == "darts_surgery.safetensors"}
        assert surgery == set(load_file(exported / kind / "darts_surgery.safetensors"))
        assert all(k.startswith("darts_surgery.") for k in surgery)
        assert not (exported / kind / "model.safetensors").exists()  # would shadow the index
        mode = (exported / kind / "config.json").stat().st_mode  # a plain file's, not 0600
        assert (exported / kind / "darts_surgery.safetensors").stat().st_mode == mode


def test_model_card(exported: Path) -> None:
    card = (exported / "add" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    for text in (
        "`add`",
        "tiny_add",
        "0.625",  # rho_L1 of the third kind
        "trust_remote_code=True",
        "vllm serve exported/add",
        "lm_eval --model vllm --model_args pretrained=exported/add",
        "lm_eval --model hf --model_args pretrained=exported/add,trust_remote_code=True",
        "merge_method: task_arithmetic",
        "(base)",
    ):
        assert text in card, text


@pytest.mark.parametrize("link", ["symlink", "hardlink", "copy"])
def test_link_modes(link: str, merged: Path, tmp_path: Path) -> None:
    dest = tmp_path / link
    run = CliRunner().invoke(
        main, ["export", str(merged), "--task", "standard", str(dest), "--link", link]
    )
    assert run.exit_code == 0, run.output
    shard = dest / "model-00001-of-00001.safetensors"
    source = merged / "model.safetensors"
    files = list(dest.iterdir())
    if link == "symlink":
        assert shard.is_symlink() and shard.resolve() == source.resolve()
    else:
        assert not [f for f in files if f.is_symlink()]
        assert (shard.stat().st_ino == source.stat().st_ino) == (link == "hardlink")
        assert shard.read_bytes() == source.read_bytes()
    assert load(dest).config.darts["task"] == "standard"


# ---- errors: one line, before anything is written ------------------------------------------------------


def test_errors_leave_dest_untouched(merged: Path, tiny_family: Any, tmp_path: Path) -> None:
    out = str(merged)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    file = tmp_path / "file"
    file.write_text("mine")
    before = snapshot(tmp_path)

    assert "has no surgery/ folder" in fail(
        str(tiny_family.base), "--task", "x", str(tmp_path / "a")
    )
    assert "no surgery task 'nope'" in fail(out, "--task", "nope", str(tmp_path / "a"))
    assert "available: standard, pos_corr, add, parallel" in fail(
        out, "--task", "nope", str(tmp_path / "a")
    )
    assert "is not empty" in fail(out, "--task", "add", str(full))
    assert "is not empty" in fail(out, "--all", str(full))
    assert "is not a folder" in fail(out, "--task", "add", str(file))
    assert "--link" in fail(out, "--task", "add", str(tmp_path / "a"), "--link", "soft")
    assert "either --task" in fail(out, str(tmp_path / "a"))
    assert "either --task" in fail(out, "--all", "--task", "add", str(tmp_path / "a"))
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "full"]


def test_other_bad_sources(merged: Path, exported: Path, tmp_path: Path) -> None:
    pickled = Path(shutil.copytree(merged, tmp_path / "pickled", symlinks=True))
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    assert "safetensors weights only" in fail(str(pickled), "--task", "add", str(tmp_path / "a"))
    assert "already a DARTS export" in fail(
        str(exported / "add"), "--task", "add", str(tmp_path / "a")
    )
    wrong = Path(shutil.copytree(merged, tmp_path / "wrong"))
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps(config | {"hidden_size": 32}))
    assert "hidden size 64" in fail(str(wrong), "--task", "add", str(tmp_path / "a"))
    custom = {"architectures": ["MyLlamaForCausalLM"], "auto_map": {"AutoModel": "my.Model"}}
    (wrong / "config.json").write_text(json.dumps(config | custom))
    assert "from custom code" in fail(str(wrong), "--task", "add", str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()


def test_hardlink_across_filesystems_is_refused(merged: Path) -> None:
    other = Path("/dev/shm")
    if not other.is_dir() or other.stat().st_dev == merged.stat().st_dev:
        pytest.skip("no second filesystem here")
    dest = other / f"darts-export-test-{os.getpid()}"
    message = fail(str(merged), "--task", "add", str(dest), "--link", "hardlink")
    assert "one filesystem" in message and "--link copy" in message
    assert not dest.exists()


@pytest.mark.parametrize("where", ["copyfile", "write_bytes"])
def test_a_full_disk_is_one_line_and_leaves_nothing(
    where: str, merged: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mergekit_darts.hosts.deploy.export as module

    def full(*_args: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if where == "copyfile":  # the merged shards (--link copy) and the tokenizer files
        monkeypatch.setattr(module.shutil, "copyfile", full)
    else:  # the surgery tensors
        monkeypatch.setattr(Path, "write_bytes", full)
    dest = tmp_path / "dest"
    dest.mkdir()  # an empty DEST stays as it was
    message = fail(str(merged), "--task", "add", str(dest), "--link", "copy")
    assert "no space left on the device" in message and "nothing was written" in message
    assert [p.name for p in tmp_path.iterdir()] == ["dest"] and not any(dest.iterdir())


def test_another_write_error_is_one_line_too(
    merged: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mergekit_darts.hosts.deploy.export as module

    def denied(src: Any, dst: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dst))

    monkeypatch.setattr(module.os, "symlink", denied)
    message = fail(str(merged), "--task", "add", str(tmp_path / "dest"))
    assert "writing failed: Permission denied" in message and "nothing was written" in message
    assert list(tmp_path.iterdir()) == []


def test_a_crafted_task_name_cannot_write_beside_dest(merged: Path, tmp_path: Path) -> None:
    """A manifest naming a task ``../escaped`` is refused before anything is written."""
    out = tmp_path / "merged"
    shutil.copytree(merged, out, symlinks=True)
    path = out / "surgery" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["tasks"]["../escaped"] = manifest["tasks"].pop("add")
    path.write_text(json.dumps(manifest))
    dest = tmp_path / "exports" / "dest"
    assert "not a valid task name" in fail(str(out), "--all", str(dest))
    assert not (tmp_path / "exports").exists()


# ---- output_hidden_states ------------------------------------------------------------------------
# What `output_hidden_states=True` returns with a surgery attached (docs/design.md): the
# correction sits on the LM head's input, so `hidden_states[-1]` is the uncorrected final hidden
# state in every transformers path (apply_surgery, hence hf-darts, and the export), and only the
# logits carry the correction.


def plain(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("path", ["apply_surgery", "export"])
def test_last_hidden_state_is_uncorrected(path, merged, exported, batch):
    h, plain_logits = head_input(plain(merged), batch)
    if path == "apply_surgery":
        model = plain(merged)
        apply_surgery(model, merged / "surgery", "pos_corr")
    else:
        model = load(exported / "pos_corr")
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(out.hidden_states[-1][real], h[real], rtol=0, atol=1e-6)
    assert (out.logits - plain_logits)[real].abs().max() > 0.1  # the logits are corrected
