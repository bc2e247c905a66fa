"""``mergekit-darts export --routed`` and the ``none`` module under plain transformers.

A routed export holds every task's module and the router in one folder: per token,
``h_hat = h - sum_k g_k(h) (c_k(h) + b_k[p])`` with ``g = softmax(W h + b)`` over the tasks (plus a
last "none" class with background). The surgery folders are random (``tiny.write_routed_surgery``:
every weight non-zero, one task of kind ``none`` among them), with and without background; the
exported model is checked against ``apply_surgery(task="routed")``, ``hf-darts surgery=routed`` and
a float64 reference of the routed formula written here, on a left-padded batch running past
``max_positions``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from reference import (
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
from tiny import write_routed_surgery
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import apply_surgery
from mergekit_darts.cli import main
from mergekit_darts.correction.modeling_darts import darts_section, weights_fingerprint
from mergekit_darts.folder.artifacts import load_routed
from mergekit_darts.folder.identity import weights_identity
from mergekit_darts.hosts.deploy.export import export

# background on / off; one task of kind none in each, the others covering every module kind
KINDS = {
    True: {"math": "pos_corr", "chat": "none", "code": "parallel"},
    False: {"math": "add", "code": "standard", "chat": "none"},
}
PREFIX = "darts_surgery."


@pytest.fixture(scope="module", params=[True, False], ids=["background", "no_background"])
def routed(request: pytest.FixtureRequest, tiny_merged: Path, tmp_path_factory: Any) -> Any:
    """(merged folder with a routed surgery, its --routed export, the background flag)."""
    background = request.param
    root = tmp_path_factory.mktemp("routed")
    merged = Path(shutil.copytree(tiny_merged, root / "merged"))
    write_routed_surgery(
        merged / "surgery",
        64,
        KINDS[background],
        background=background,
        rank=RANK,
        max_positions=MAX_POSITIONS,
        seed=3,
    )
    run = CliRunner().invoke(main, ["export", str(merged), "--routed", str(root / "dest")])
    assert run.exit_code == 0, run.output
    return merged, root / "dest", background


@pytest.fixture(scope="module")
def batch(tiny_family: Any) -> dict[str, torch.Tensor]:
    """Left-padded prompts of very different lengths; the longest runs past MAX_POSITIONS."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_family.base, padding_side="left")
    prompts = [tiny_family.prompts[6], tiny_family.prompts[4], tiny_family.prompts[1]]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True)
    lengths = encoded["attention_mask"].sum(-1).tolist()
    assert max(lengths) > MAX_POSITIONS + 2 and min(lengths) < MAX_POSITIONS
    return dict(encoded)


def routed_reference(merged: Path, **kwargs: Any) -> Any:
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, **kwargs).eval()
    apply_surgery(model, merged / "surgery", task="routed")
    return model


def routed64(
    kinds: dict[str, str], state: dict[str, torch.Tensor], h: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """h - sum_k softmax(W h + b)_k (h - corrected64_k(h, p)) in float64, from the exported tensors."""
    h64 = h.double()
    w = {k.removeprefix(PREFIX): v.double() for k, v in state.items()}
    gate = torch.softmax(h64 @ w["router.weight"].T + w["router.bias"], dim=-1)
    total = torch.zeros_like(h64)
    for k, kind in enumerate(kinds.values()):
        own = {n.removeprefix(f"corrections.{k}."): v for n, v in w.items()}
        own = {n: v for n, v in own.items() if not n.startswith(("corrections.", "router."))}
        if kind == "none":
            assert not own  # no tensors: adds nothing
            continue
        total = total + gate[..., k : k + 1] * (h64 - corrected64(kind, own, h64, pos))
    return h64 - total


# ---- numbers -----------------------------------------------------------------------------------------


def test_logits_equal_apply_surgery_and_a_float64_reference(
    routed: Any, batch: dict[str, torch.Tensor]
) -> None:
    merged, dest, background = routed
    model = load(dest)
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    assert type(model).__name__ == "DartsLlamaForCausalLM"
    assert type(model.darts_surgery).__name__ == "RoutedSurgery"
    with torch.no_grad():
        logits = model(**batch).logits
        last = model(**batch, logits_to_keep=1).logits
        expected = routed_reference(merged)(**batch).logits
        h, plain_logits = head_input(plain, batch)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(last, logits[:, -1:], rtol=0, atol=1e-6)

    state = load_file(dest / "darts_surgery.safetensors")
    h_hat = routed64(KINDS[background], state, h, positions_by_hand(batch["attention_mask"]))
    reference = h_hat @ plain.lm_head.weight.double().T
    real = batch["attention_mask"].bool()
    error = float((logits[real].double() - reference[real]).abs().max().detach())
    print(f"routed export vs float64 reference (background={background}): max error {error:.2e}")
    assert error < 1e-4
    assert (logits - plain_logits)[real].abs().max() > 0.1  # the correction is really there
    # and the gate really mixes: more than one class wins somewhere in the batch
    gate = torch.softmax(
        h[real] @ state[PREFIX + "router.weight"].T + state[PREFIX + "router.bias"], -1
    )
    assert len(set(gate.argmax(-1).tolist())) > 1


def test_cached_generate_equals_apply_surgery(routed: Any, batch: dict[str, torch.Tensor]) -> None:
    merged, dest, _ = routed

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

    tokens, logits = generate(load(dest))
    want_tokens, want_logits = generate(routed_reference(merged))
    assert torch.equal(tokens, want_tokens)
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("split", "dtype"),
    [(True, torch.float32), (False, torch.float32), (False, torch.bfloat16)],
    ids=["cpu_and_disk", "disk", "disk_bfloat16"],
)
def test_offloaded_export_equals_the_whole_one(
    routed: Any, split: bool, dtype: torch.dtype, batch: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """With the surgery on disk, every task's tensors come in for the correction, also those the
    routed module reads without calling their module's forward (the position tables)."""
    _, dest, _ = routed
    offloaded = load_offloaded(dest, tmp_path, split, dtype=dtype)
    assert all(p.dtype == torch.float32 for p in offloaded.darts_surgery.parameters())
    with torch.no_grad():
        expected = load(dest, dtype=dtype)(**batch).logits
        got = offloaded(**batch).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_batch_and_padding_invariance(routed: Any, tiny_family: Any) -> None:
    """Each prompt alone, in a left-padded batch and in a right-padded batch: the same logits."""
    _, dest, _ = routed
    model = load(dest)
    prompts = tiny_family.prompts[:6]
    sides = {
        s: AutoTokenizer.from_pretrained(dest, padding_side=s, trust_remote_code=True)
        for s in ("left", "right")
    }
    with torch.no_grad():
        alone = [model(**sides["left"](p, return_tensors="pt")).logits[0] for p in prompts]
        for tokenizer in sides.values():
            encoded = tokenizer(prompts, return_tensors="pt", padding=True)
            logits = model(**encoded).logits
            for row, single in enumerate(alone):
                real = encoded["attention_mask"][row].bool()
                torch.testing.assert_close(logits[row][real], single, rtol=0, atol=1e-5)


def test_hf_darts_routed_equals_apply_surgery_and_the_export(routed: Any, tiny_family: Any) -> None:
    """hf-darts ``surgery=routed``: lm-eval's right-padded, mask-free call, and its requests."""
    from lm_eval.api.instance import Instance

    from lm_eval_darts.model import DartsHFLM

    merged, dest, _ = routed
    lm = DartsHFLM(pretrained=str(merged), surgery="routed", device="cpu", dtype="float32")
    reference, exported = routed_reference(merged), load(dest)
    seqs = [lm.tok_encode(p) for p in tiny_family.prompts[:6]]
    width = max(map(len, seqs))
    pad = lm.tokenizer.pad_token_id
    right = torch.tensor([ids + [pad] * (width - len(ids)) for ids in seqs])
    logits = lm._model_call(right)
    with torch.no_grad():
        for row, ids in zip(logits, seqs, strict=True):
            want = reference(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(row[: len(ids)], want, rtol=0, atol=1e-6)
            got = exported(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    pairs = [(p.rsplit(" ", 2)[0], " " + " ".join(p.split()[-2:])) for p in tiny_family.prompts]
    requests = [
        Instance("loglikelihood", doc={}, arguments=pair, idx=i, metadata=("x", i, 1))
        for i, pair in enumerate(pairs)
    ]
    for (context, continuation), (logprob, _) in zip(
        pairs, lm.loglikelihood(requests), strict=True
    ):
        ctx, cont = lm._encode_pair(context, continuation)
        with torch.no_grad():
            out = exported(torch.tensor([ctx + cont[:-1]])).logits[0]
        expected = torch.log_softmax(out.double(), -1)[-len(cont) :]
        expected = expected.gather(1, torch.tensor(cont)[:, None]).sum()
        assert logprob == pytest.approx(float(expected), abs=1e-5)


def test_half_precision_keeps_the_routed_surgery_float32(routed: Any) -> None:
    _, dest, _ = routed
    full = load(dest)
    weights = {k: v.clone() for k, v in full.darts_surgery.state_dict().items()}
    loaded = load(dest, dtype=torch.bfloat16)
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    for name, value in loaded.darts_surgery.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, weights[name]), name


# ---- the folder --------------------------------------------------------------------------------------


def test_routed_folder_layout(routed: Any) -> None:
    merged, dest, background = routed
    kinds = KINDS[background]
    config = json.loads((dest / "config.json").read_text())
    assert config["darts"] == {
        "format": "darts-export",
        "version": 1,
        "base_model_type": "llama",
        "base_architecture": "LlamaForCausalLM",
        "module": "routed",
        "routed": {
            "tasks": [
                {"name": n, "module": k, "rank": RANK, "max_positions": MAX_POSITIONS}
                for n, k in kinds.items()
            ],
            "background": background,
        },
        "hidden_size": 64,
        "prefix": "darts_surgery.",
        "weights": {
            "darts_surgery.safetensors": weights_fingerprint(dest / "darts_surgery.safetensors"),
            "model-00001-of-00001.safetensors": weights_fingerprint(merged / "model.safetensors"),
        },
    }
    # the tensors are the RoutedSurgery state dict's, prefixed; the none module has none
    routed_module = load_routed(merged / "surgery")
    names = {PREFIX + k for k in routed_module.state_dict()}
    state = load_file(dest / "darts_surgery.safetensors")
    assert set(state) == names
    none = list(kinds.values()).index("none")
    assert not [k for k in names if k.startswith(f"{PREFIX}corrections.{none}.")]
    assert state[PREFIX + "router.weight"].shape == (len(kinds) + background, 64)
    for key, value in routed_module.state_dict().items():
        assert torch.equal(state[PREFIX + key], value), key
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert {k for k, v in index["weight_map"].items() if v == "darts_surgery.safetensors"} == names
    card = (dest / "README.md").read_text()
    for text in ("`math`", "`code`", "`chat`", "router", f"vllm serve {dest.name}"):
        assert text in card, text
    assert ("needs none" in card) == background


def test_routed_from_config_is_the_identity(routed: Any) -> None:
    _, dest, _ = routed
    config = AutoConfig.from_pretrained(dest, trust_remote_code=True)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    assert all(not p.any() for p in model.darts_surgery.parameters())


def test_routed_save_pretrained_round_trip(
    routed: Any, batch: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    _, dest, _ = routed
    model = load(dest)
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    original = json.loads((dest / "config.json").read_text())
    assert config["darts"] == {k: v for k, v in original["darts"].items() if k != "weights"}
    with torch.no_grad():
        assert torch.equal(load(tmp_path / "saved")(**batch).logits, model(**batch).logits)


# ---- the none module ------------------------------------------------------------------------------


def test_a_none_export_serves_the_plain_merge(
    routed: Any, batch: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    merged, _, _ = routed
    dest = tmp_path / "chat"
    export(merged, dest, "chat")
    config = json.loads((dest / "config.json").read_text())
    assert config["darts"]["module"] == "none" and config["darts"]["task"] == "chat"
    assert not (dest / "darts_surgery.safetensors").exists()  # no tensors, no file
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    assert not [k for k in index["weight_map"] if k.startswith(PREFIX)]
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    assert "identity" in (dest / "README.md").read_text()
    model = load(dest)
    assert list(model.darts_surgery.parameters()) == []
    plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, plain(**batch).logits)
        kwargs = dict(max_new_tokens=STEPS, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(**batch, **kwargs), plain.generate(**batch, **kwargs))
        applied = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        apply_surgery(applied, merged / "surgery", "chat")
        assert torch.equal(applied(**batch).logits, plain(**batch).logits)


@pytest.mark.slow
def test_loads_where_mergekit_darts_is_not_installed(
    routed: Any, batch: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    merged, dest, _ = routed
    none = tmp_path / "none"
    export(merged, none, "chat")
    logits = logits_without_darts([str(dest), str(none)], batch, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(
            logits[str(dest)], routed_reference(merged)(**batch).logits, rtol=0, atol=1e-6
        )
        plain = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        assert torch.equal(logits[str(none)], plain(**batch).logits)


# ---- refusals ----------------------------------------------------------------------------------------


def damaged(merged: Path, folder: Path, change: Any) -> Path:
    """A copy of ``merged`` whose surgery manifest (dict) ``change`` edits in place."""
    folder = Path(shutil.copytree(merged, folder, symlinks=True))
    path = folder / "surgery" / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))
    return folder


def test_refusals_leave_dest_untouched(routed: Any, tiny_family: Any, tmp_path: Path) -> None:
    merged, _, background = routed
    sources = tmp_path / "sources"
    other = weights_identity(tiny_family.base)  # calibrated on other weights than the merge's
    remerged = damaged(merged, sources / "e", lambda m: m.__setitem__("merged_identity", other))
    no_router = damaged(merged, sources / "a", lambda m: m.pop("router"))
    ghost = damaged(merged, sources / "b", lambda m: m["router"]["tasks"].__setitem__(0, "ghost"))
    missing = Path(shutil.copytree(merged, sources / "c"))
    router_file = missing / "surgery" / "router.safetensors"
    save_file({"weight": load_file(router_file)["weight"]}, router_file)
    gone = Path(shutil.copytree(merged, sources / "d"))
    (gone / "surgery" / "router.safetensors").unlink()
    dests = tmp_path / "dests"
    dests.mkdir()
    full = dests / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)

    new = str(dests / "new")
    message = fail(str(no_router), "--routed", new)
    assert "has no router" in message and "add `route:`" in message
    message = fail(str(ghost), "--routed", new)
    assert "weighs task(s) ghost" in message and "re-run `mergekit-darts calibrate`" in message
    assert "router over" in fail(str(missing), "--routed", new)
    assert "missing or unreadable" in fail(str(gone), "--routed", new)
    assert "was calibrated on other weights" in fail(str(remerged), "--routed", new)
    assert "is not empty" in fail(str(merged), "--routed", str(full))
    assert "either --task NAME, --all, --routed or --joint" in fail(
        str(merged), "--routed", "--task", "math", new
    )
    assert "either --task" in fail(str(merged), "--routed", "--all", new)
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in dests.iterdir()) == ["full"]


BAD_ROUTED = [
    ({"routed": None}, "darts.routed must be"),
    ({"routed": {"tasks": []}}, "darts.routed must be"),
    ({"task": "math"}, "single-task field"),
    ({"rank": 4}, "single-task field"),
    (("background", "yes"), "background must be true or false"),
    (("tasks", "math"), "tasks must list two or more"),
    (("tasks", [{"name": "math", "module": "pos_corr", "rank": 4, "max_positions": 8}]),
     "two or more"),
    (("task0", {"name": "math"}), r"tasks\[0\] must have exactly the keys"),
    (("task0", {"module": "routed"}), r"tasks\[0\].module 'routed'"),
    (("task0", {"rank": 0}), r"tasks\[0\] needs positive integers"),
    (("task0", {"max_positions": True}), r"tasks\[0\] needs positive integers"),
    (("task0", {"name": ""}), r"tasks\[0\].name"),
    (("task0", {"name": "code"}), "names a task twice"),
]  # fmt: skip


def bad_section(darts: dict, change: Any) -> None:
    if isinstance(change, dict):
        darts.update(change)
        return
    key, value = change
    if key == "task0":
        if value == {"name": "math"}:
            darts["routed"]["tasks"][0] = value
        else:
            darts["routed"]["tasks"][0].update(value)
    else:
        darts["routed"][key] = value


@pytest.mark.parametrize("change, message", BAD_ROUTED)
def test_a_bad_routed_section_is_one_line_under_transformers(
    change: Any, message: str, routed: Any, tmp_path: Path
) -> None:
    _, dest, _ = routed
    folder = Path(shutil.copytree(dest, tmp_path / "bad", symlinks=True))
    config = json.loads((folder / "config.json").read_text())
    if change == ("task0", {"name": "code"}):  # a name that is already another task's
        change = ("task0", {"name": config["darts"]["routed"]["tasks"][1]["name"]})
    bad_section(config["darts"], change)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as checked:
        darts_section(config)
    assert "\n" not in str(checked.value) and "mergekit-darts export" in str(checked.value)
    with pytest.raises(ValueError) as info:
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    assert str(info.value) == str(checked.value)


def test_a_single_task_section_with_a_routed_entry_is_refused(routed: Any) -> None:
    _, dest, _ = routed
    config = json.loads((dest / "config.json").read_text())
    routed_entry = config["darts"]["routed"]
    config["darts"].update(module="pos_corr", task="math", rank=4, max_positions=8)
    with pytest.raises(ValueError, match="has a routed entry"):
        darts_section(config)
    del config["darts"]["routed"]
    darts_section(config)  # and without it, a valid single-task section
    assert routed_entry["tasks"]


def test_missing_routed_tensors_are_refused(routed: Any, tmp_path: Path) -> None:
    _, dest, _ = routed
    folder = Path(shutil.copytree(dest, tmp_path / "bad", symlinks=True))
    kept = {
        k: v
        for k, v in load_file(folder / "darts_surgery.safetensors").items()
        if not k.startswith(PREFIX + "router.")
    }
    save_file(kept, folder / "darts_surgery.safetensors", metadata={"format": "pt"})
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {
        k: v for k, v in index["weight_map"].items() if not k.startswith(PREFIX + "router.")
    }
    index_file.write_text(json.dumps(index))
    unbind_surgery_file(folder)
    with pytest.raises(ValueError, match=r"darts_surgery\.\* tensors do not fit") as info:
        load(folder)
    assert "darts_surgery.router.weight" in str(info.value) and "\n" not in str(info.value)
