"""Routing (correction.darts_correction): the routed correction against a float64 reference written here, the
router file round trip, and every refusal of a router that does not fit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tiny import random_module, random_router, write_routed_surgery
from transformers import AutoModelForCausalLM, AutoTokenizer

from mergekit_darts import apply_surgery
from mergekit_darts.correction.darts_correction import RoutedSurgery, Router
from mergekit_darts.correction.modules import build_module
from mergekit_darts.errors import SurgeryFormatError
from mergekit_darts.folder.artifacts import load_routed, load_surgery
from mergekit_darts.task_map import check_task_name

H, RANK, MAX_POSITIONS = 16, 4, 6
KINDS = {"code": "pos_corr", "math": "standard", "chat": "none"}


def reference_routed(
    h: torch.Tensor, positions: torch.Tensor, modules: dict, router: Router
) -> torch.Tensor:
    """h - sum_k softmax(W h + b)_k * (W_up,k relu(W_down,k h) + b_k[p]) in float64, by hand."""
    h64 = h.double()
    gate = torch.softmax(h64 @ router.weight.double().T + router.bias.double(), dim=-1)
    total = torch.zeros_like(h64)
    for k, module in enumerate(modules.values()):
        state = {name: t.double() for name, t in module.state_dict().items()}
        if not state:  # the `none` module adds nothing
            continue
        content = torch.relu(h64 @ state["down.weight"].T) @ state["up.weight"].T
        if "position_bias" in state:
            inside = ((positions >= 0) & (positions < MAX_POSITIONS)).unsqueeze(-1)
            rows = state["position_bias"][positions.clamp(0, MAX_POSITIONS - 1)]
            content = content + rows * inside
        total = total + gate[..., k : k + 1] * content
    return h64 - total


def test_routed_correction_matches_float64_reference():
    modules = {
        name: random_module(kind, H, RANK, MAX_POSITIONS, seed=i)
        for i, (name, kind) in enumerate(KINDS.items())
    }
    router = random_router(H, list(KINDS), background=True, seed=7)
    routed = RoutedSurgery(modules, router)
    h = torch.randn(3, 9, H, generator=torch.Generator().manual_seed(1))
    positions = torch.tensor([[-1, -1, 0, 1, 2, 3, 4, 5, 6], list(range(9)), [0] * 9])
    expected = reference_routed(h, positions, modules, router)
    assert torch.allclose(routed(h, positions).double(), expected, atol=1e-5)
    # every class really contributes: a gate on one task alone gives another answer
    assert not torch.allclose(routed(h, positions), modules["code"](h, positions), atol=1e-3)


def test_none_module_is_the_identity_and_has_no_tensors():
    none = build_module("none", H, RANK, MAX_POSITIONS)
    h = torch.randn(2, 3, H)
    assert torch.equal(none(h, torch.zeros(2, 3, dtype=torch.long)), h)
    assert none.state_dict() == {}


def test_router_must_match_its_modules():
    modules = {name: build_module("standard", H, RANK, MAX_POSITIONS) for name in ("a", "b")}
    with pytest.raises(ValueError, match="do not match the modules"):
        RoutedSurgery(modules, Router(H, ["b", "a"]))
    with pytest.raises(ValueError, match="two or more distinct tasks"):
        Router(H, ["a"])


@pytest.mark.parametrize("name", ["routed", "Routed", "auto", "none"])
def test_reserved_names(name):
    with pytest.raises(ValueError, match="reserved"):
        check_task_name(name)


def test_round_trip_and_refusals(tmp_path: Path):
    folder = tmp_path / "surgery"
    modules = write_routed_surgery(folder, H, KINDS, rank=RANK, max_positions=MAX_POSITIONS)
    routed = load_routed(folder)
    assert routed.tasks == tuple(KINDS) and routed.router.classes[-1] == "none"
    h, positions = torch.randn(2, 5, H), torch.arange(5).expand(2, 5)
    reference = reference_routed(h, positions, modules, routed.router)
    assert torch.allclose(routed(h, positions).double(), reference, atol=1e-5)
    assert load_surgery(folder, "chat").kind == "none"

    manifest = json.loads((folder / "manifest.json").read_text())
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    manifest["router"]["tasks"] = ["code", "math", "poetry"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SurgeryFormatError, match="router weighs task.*poetry"):
        load_routed(damaged)
    manifest["router"]["tasks"] = ["code", "math"]  # the file still has three task rows + none
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SurgeryFormatError, match="needs"):
        load_routed(damaged)
    del manifest["router"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SurgeryFormatError, match="no router.*route:"):
        load_routed(damaged)


def test_apply_routed_is_batch_and_padding_invariant(tiny_family, tmp_path: Path):
    merged = Path(shutil.copytree(tiny_family.base, tmp_path / "merged"))
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    hidden = model.config.hidden_size
    modules = write_routed_surgery(
        merged / "surgery", hidden, KINDS, rank=RANK, max_positions=MAX_POSITIONS
    )
    tokenizer = AutoTokenizer.from_pretrained(merged, padding_side="left")
    prompts = tiny_family.prompts[:5]
    with torch.no_grad():
        plain = [
            model(**tokenizer(p, return_tensors="pt"), output_hidden_states=True) for p in prompts
        ]
        with apply_surgery(model, merged / "surgery", task="routed") as handle:
            assert isinstance(handle.module, RoutedSurgery)
            batch = tokenizer(prompts, return_tensors="pt", padding=True)
            logits = model(**batch).logits
            single = [model(**tokenizer(p, return_tensors="pt")).logits for p in prompts]
    head = model.get_output_embeddings().weight.double()
    for i, out in enumerate(plain):
        h = out.hidden_states[-1][0]
        n = h.shape[0]
        expected = reference_routed(h, torch.arange(n), modules, handle.module.router) @ head.T
        assert torch.allclose(single[i][0].double(), expected, atol=1e-4)
        assert torch.allclose(logits[i, -n:].double(), expected, atol=1e-4)


def test_apply_routed_without_router_names_route(tiny_family, tmp_path: Path):
    merged = Path(shutil.copytree(tiny_family.base, tmp_path / "merged"))
    write_routed_surgery(merged / "surgery", 64, KINDS, rank=RANK, max_positions=MAX_POSITIONS)
    manifest = json.loads((merged / "surgery/manifest.json").read_text())
    del manifest["router"]
    (merged / "surgery/manifest.json").write_text(json.dumps(manifest))
    model = AutoModelForCausalLM.from_pretrained(merged)
    with pytest.raises(SurgeryFormatError, match="add `route:`"):
        apply_surgery(model, merged / "surgery", task="routed")
