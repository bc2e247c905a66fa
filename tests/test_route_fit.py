"""`route:` through the real pipeline on the tiny family, and the gate's fit on its own.

Numbers are checked against float64 references written here: the held-out accuracies and the
confusion recomputed from the stored router and hidden states the merged model computes again;
the fit's optimality from the gradient of its objective; the routed logits by hand.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from tiny import surgery_task
from transformers import AutoModelForCausalLM, AutoTokenizer

from lm_eval_darts.leakage import LeakageCheck
from mergekit_darts import apply_surgery, run_surgery
from mergekit_darts.calibrate.capture import Captured
from mergekit_darts.calibrate.data import sha256_text
from mergekit_darts.calibrate.fit_router import fit_router, route_classes
from mergekit_darts.calibrate.selection import holdout_split
from mergekit_darts.correction.darts_correction import RoutedSurgery
from mergekit_darts.folder.artifacts import load_routed, read_manifest
from mergekit_darts.folder.manifest import ROUTER

# Three clearly different word pools: two routed tasks and background text.
POOLS = {
    "math": "one two three four five six seven eight nine zero plus minus times is = question",
    "code": "def return add sub mul x y z n k l ( ) : , for in print if then else",
    "general": "cat dog red blue green sun moon tree river stone fire water the a and or",
}
MAX_LENGTH = 16


def write_prompts(folder: Path, seed: int = 0, count: int = 12) -> dict[str, Path]:
    rng = random.Random(seed)
    files = {}
    for name, pool in POOLS.items():
        words = pool.split()
        lines = [
            json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(6, 12)))})
            for _ in range(count)
        ]
        files[name] = folder / f"{name}.jsonl"
        files[name].write_text("\n".join(lines) + "\n")
    return files


def routed_block(tiny_family, files: dict[str, Path], **route) -> dict:
    calibration = {"max_length": MAX_LENGTH}
    tasks = [
        surgery_task(
            name, getattr(tiny_family, name), files[name], field=None, calibration=calibration
        )
        for name in ("math", "code")
    ]
    background = {"path": str(files["general"]), **calibration}
    return {
        "steps": 5,
        "select": "off",  # one module per task, the captures counted below
        "batch_size": 4,
        "rank": 4,
        "max_positions": MAX_LENGTH,
        "cache_dtype": "float32",
        "route": {"background": background, "holdout": 0.25, **route},
        "tasks": tasks,
    }


@pytest.fixture(scope="module")
def routed(tiny_family, tiny_merged, tmp_path_factory):
    """One routed run; every model load is recorded (the real from_pretrained runs)."""
    root = tmp_path_factory.mktemp("routed")
    files = write_prompts(root)
    merged = Path(shutil.copytree(tiny_merged, root / "merged"))
    block = routed_block(tiny_family, files)
    loads: list[str] = []
    original = AutoModelForCausalLM.from_pretrained

    def counting(path, *args, **kwargs):
        loads.append(Path(path).name)
        return original(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AutoModelForCausalLM, "from_pretrained", counting)
        manifest = run_surgery(merged, block, progress=False)
    return merged, block, files, manifest, loads


@pytest.mark.slow
def test_background_costs_no_extra_model_load(routed):
    _, _, _, manifest, loads = routed
    assert loads == ["math", "code", "merged"]  # targets once each, the merge once
    assert manifest["captures"]["model_loads"] == 3
    # math, code (target and merged) and the background (merged only)
    assert manifest["captures"]["computed"] == 5


@pytest.mark.slow
def test_manifest_router_entry(routed):
    merged, _, files, manifest, _ = routed
    router = manifest["router"]
    assert router["tasks"] == ["math", "code"] and router["background"] is True
    assert router["file"] == ROUTER and (merged / "surgery" / ROUTER).is_file()
    assert router["fitted_on"] == "prompts not held out"
    held = router["held_out"]
    assert held["classes"] == ["math", "code", "none"]
    # 12 prompts per class, 0.25 held out: 3 per class, by the block's seed
    texts = {
        n: [json.loads(line)["text"] for line in f.read_text().splitlines()]
        for n, f in files.items()
    }
    for cls, name in (("math", "math"), ("code", "code"), ("none", "general")):
        _, rows = holdout_split(12, 0.25, 0)
        assert held["prompt_sha256"][cls] == [sha256_text(texts[name][i]) for i in rows.tolist()]
        assert held["per_task"][cls]["prompts"] == 3
        assert router["fit"]["prompts"][cls] == 9
    confusion = torch.tensor(held["confusion"])
    assert int(confusion.sum()) == held["tokens"]
    assert confusion.sum(1).tolist() == [held["per_task"][c]["tokens"] for c in held["classes"]]
    background = router["background_calibration"]
    assert background["num_prompts"] == 12 and len(background["prompt_sha256"]) == 12
    assert router["timings"]["fit_s"] >= 0
    # clearly different prompt sets: the gate tells them apart (the shared first token, BOS, and
    # a few shared words cannot be)
    assert held["sequence_accuracy"] == 1.0 and held["token_accuracy"] > 0.75


def reference_routed(h: torch.Tensor, modules: dict, router) -> torch.Tensor:
    """h - sum_k softmax(W h + b)_k (W_up,k relu(W_down,k h) + b_k[p]) in float64, positions
    0..n-1 of one prompt, by hand."""
    gate = torch.softmax(h @ router.weight.double().T + router.bias.double(), dim=-1)
    positions = torch.arange(h.shape[0])
    total = torch.zeros_like(h)
    for k, module in enumerate(modules.values()):
        state = {name: t.double() for name, t in module.state_dict().items()}
        if not state:  # `none` adds nothing
            continue
        content = torch.relu(h @ state["down.weight"].T) @ state["up.weight"].T
        if "position_bias" in state:
            inside = (positions < module.max_positions).unsqueeze(-1)
            table = state["position_bias"]
            content = content + table[positions.clamp(max=module.max_positions - 1)] * inside
        total = total + gate[:, k : k + 1] * content
    return h - total


def _final_states(model, tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text)["input_ids"][:MAX_LENGTH]
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    return out.hidden_states[-1][0].double()


@pytest.mark.slow
def test_held_out_numbers_recomputed_in_float64(routed):
    """Held-out prompts by their hashes, run through the merged model again; the stored gate in
    float64 must give the manifest's confusion and accuracies."""
    merged, _, files, manifest, _ = routed
    held = manifest["router"]["held_out"]
    gate = load_routed(merged / "surgery").router
    weight, bias = gate.weight.double(), gate.bias.double()
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged)
    confusion = torch.zeros(3, 3, dtype=torch.int64)
    right_prompts = [0, 0, 0]
    for label, (cls, name) in enumerate((("math", "math"), ("code", "code"), ("none", "general"))):
        texts = [json.loads(line)["text"] for line in files[name].read_text().splitlines()]
        by_hash = {sha256_text(t): t for t in texts}
        for sha in held["prompt_sha256"][cls]:
            h = _final_states(model, tokenizer, by_hash[sha])
            probs = torch.softmax(h @ weight.T + bias, dim=-1)
            for predicted in probs.argmax(-1).tolist():
                confusion[label, predicted] += 1
            right_prompts[label] += int(int(probs.mean(0).argmax()) == label)
    assert confusion.tolist() == held["confusion"]
    tokens = confusion.sum(1)
    for label, cls in enumerate(held["classes"]):
        numbers = held["per_task"][cls]
        assert numbers["token_accuracy"] == pytest.approx(
            float(confusion[label, label] / tokens[label])
        )
        assert numbers["sequence_accuracy"] == pytest.approx(right_prompts[label] / 3)
    assert held["token_accuracy"] == pytest.approx(float(confusion.diagonal().sum() / tokens.sum()))
    assert held["sequence_accuracy"] == pytest.approx(sum(right_prompts) / 9)


@pytest.mark.slow
def test_routed_logits_match_a_float64_reference(routed):
    merged, _, files, _, _ = routed
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged)
    routed_module = load_routed(merged / "surgery")
    modules = {task: routed_module.module(task) for task in routed_module.tasks}
    head = model.get_output_embeddings().weight.double()
    texts = [
        json.loads(line)["text"] for f in files.values() for line in f.read_text().splitlines()[:2]
    ]
    for text in texts:
        h = _final_states(model, tokenizer, text)
        expected = reference_routed(h, modules, routed_module.router) @ head.T
        batch = tokenizer(text, return_tensors="pt")
        with torch.no_grad(), apply_surgery(model, merged / "surgery", task="routed") as handle:
            assert isinstance(handle.module, RoutedSurgery)
            logits = model(**batch).logits[0].double()
        assert torch.allclose(logits, expected, atol=1e-4)


@pytest.mark.slow
def test_same_seed_same_router_bytes_another_seed_another_split(routed, tiny_family, tmp_path):
    merged, block, _, manifest, _ = routed
    again = Path(shutil.copytree(merged, tmp_path / "again"))
    run_surgery(again, block, progress=False, overwrite=True, write_card=False)
    assert (again / "surgery" / ROUTER).read_bytes() == (merged / "surgery" / ROUTER).read_bytes()
    other = json.loads(json.dumps(block)) | {"seed": 1}
    written = run_surgery(again, other, progress=False, overwrite=True, write_card=False)
    assert (
        written["router"]["held_out"]["prompt_sha256"]
        != manifest["router"]["held_out"]["prompt_sha256"]
    )


@pytest.mark.slow
def test_summary_and_card_show_the_router(routed, capsys):
    from rich.console import Console

    from mergekit_darts.present.summary import print_summary

    merged, _, _, manifest, _ = routed
    card = (merged / "README.md").read_text()
    assert "### Router" in card and "surgery=routed" in card
    held = manifest["router"]["held_out"]
    assert f"| all | 9 | {held['tokens']} | {held['token_accuracy']:.3f} | 1.000 |" in card
    console = Console(width=140, record=True)
    print_summary(read_manifest(merged / "surgery"), console)
    text = console.export_text()
    assert "router: held-out prompts" in text and f"{held['token_accuracy']:.3f}" in text


@pytest.mark.slow
def test_route_tasks_subset_without_background(routed, tiny_family, tmp_path):
    """`route.tasks` picks the gate's classes; a third task stays out of the gate."""
    merged, block, files, _, _ = routed
    block = json.loads(json.dumps(block))
    block["route"] = {"tasks": ["code", "math"], "holdout": 0.5}
    block["tasks"].append(dict(block["tasks"][0], name="math_again", eval_tasks=["m2"]))
    out = Path(shutil.copytree(merged, tmp_path / "subset"))
    manifest = run_surgery(out, block, progress=False, overwrite=True, write_card=False)
    router = manifest["router"]
    assert router["tasks"] == ["code", "math"] and router["background"] is False
    assert router["held_out"]["classes"] == ["code", "math"]
    assert "background_calibration" not in router
    assert load_routed(out / "surgery").router.weight.shape == (2, 64)


@pytest.mark.slow
def test_leakage_under_routed_checks_every_routed_task(routed):
    merged, _, files, _, _ = routed
    check = LeakageCheck(AutoTokenizer.from_pretrained(merged))
    texts = [json.loads(f.read_text().splitlines()[0])["text"] for f in files.values()]
    requests = [
        Instance("generate_until", {}, (f"say {text} now", {}), i, (f"t{i}", i, 1))
        for i, text in enumerate(texts)
    ]
    check.check(requests, merged / "surgery", lambda task: "routed")
    # a math prompt and a code prompt are found; background text is no task's calibration
    assert check.counts == {"t0": 1, "t1": 1, "t2": 0}


# ---- the fit on its own -----------------------------------------------------------------------


def _blobs(n_prompts: list[int], hidden: int, seed: int, noise: float = 3.0) -> list[Captured]:
    """One capture per class: prompts of 5-9 tokens around a class centre, float32."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(n_prompts):
        centre = 2.0 * torch.randn(hidden, generator=g) + 10.0 * (k + 1)  # far from 0, unscaled
        lengths = torch.randint(5, 10, (n,), generator=g)
        states = centre + noise * torch.randn(n, 9, hidden, generator=g)
        mask = torch.arange(9) < lengths.unsqueeze(-1)
        out.append(Captured(hidden=states * mask.unsqueeze(-1), mask=mask))
    return out


def test_fit_is_a_stationary_point_of_the_balanced_regularised_objective():
    """The stored W, b minimise sum_i w_i CE(W h_i + b) + l2/2 ||W * s||^2 (w_i = 1/(K n_k),
    s the class-balanced standard deviation): its float64 gradient vanishes there."""
    hidden, l2 = 6, 0.05
    captures = _blobs([10, 6, 14], hidden, seed=3)  # unequal classes: balancing matters
    classes = route_classes(
        [
            (f"t{k}", c, c.mask, [str(i) for i in range(len(c.mask))])
            for k, c in enumerate(captures[:2])
        ],
        (captures[2], [str(i) for i in range(len(captures[2].mask))]),
    )
    fitted = fit_router(classes, background=True, holdout=0.2, l2=l2, steps=500, seed=0)
    assert fitted.router.classes == ("t0", "t1", "none")
    xs, ys, ws = [], [], []
    for k, c in enumerate(classes):
        train, _ = holdout_split(c.counted.shape[0], 0.2, 0)
        keep = c.counted & torch.isin(torch.arange(c.counted.shape[0]), train).unsqueeze(-1)
        x = c.merged.hidden[keep].double()
        xs.append(x)
        ys.append(torch.full((x.shape[0],), k))
        ws.append(torch.full((x.shape[0],), 1.0 / (3 * x.shape[0]), dtype=torch.float64))
    x, y, w = torch.cat(xs), torch.cat(ys), torch.cat(ws)
    mean = w @ x
    scale = (w @ (x - mean) ** 2).sqrt()
    weight = fitted.router.weight.detach().double().requires_grad_(True)
    bias = fitted.router.bias.detach().double().requires_grad_(True)
    ce = torch.nn.functional.cross_entropy(x @ weight.T + bias, y, reduction="none") @ w
    loss = ce + 0.5 * l2 * ((weight * scale) ** 2).sum()
    loss.backward()
    # gradient in the standardised coordinates (what the optimiser saw): dL/dV = dL/dW / s
    grad_v = weight.grad / scale
    assert grad_v.abs().max() < 1e-3 and bias.grad.abs().max() < 1e-3
    assert fitted.entry["fit"]["loss"] == pytest.approx(float(loss.detach()), rel=1e-4)
    # balanced: with the bias free, every class gets the same weighted share of the gate
    # (sum_i w_i g_k(h_i) = 1/K'), whatever its token count; and the blobs are told apart
    probs = torch.softmax(x @ weight.detach().T + bias.detach(), -1)
    assert torch.allclose(w @ probs, torch.full((3,), 1 / 3, dtype=torch.float64), atol=1e-4)
    assert float((probs.argmax(-1) == y).double().mean()) > 0.95


def test_fit_is_deterministic_and_held_out_numbers_are_its_own():
    captures = _blobs([8, 8], 5, seed=1, noise=20.0)  # overlapping: some tokens go wrong
    classes = route_classes(
        [(f"t{k}", c, c.mask, [str(i) for i in range(8)]) for k, c in enumerate(captures)], None
    )
    a = fit_router(classes, background=False, holdout=0.25, l2=1e-3, steps=50, seed=4)
    b = fit_router(classes, background=False, holdout=0.25, l2=1e-3, steps=50, seed=4)
    assert torch.equal(a.router.weight, b.router.weight) and torch.equal(
        a.router.bias, b.router.bias
    )
    assert a.entry["held_out"] == b.entry["held_out"]
    # recount by hand from the saved gate
    right = tokens = 0
    for k, c in enumerate(classes):
        _, held = holdout_split(8, 0.25, 4)
        for row in held.tolist():
            h = c.merged.hidden[row][c.counted[row]].double()
            predicted = (h @ a.router.weight.double().T + a.router.bias.double()).argmax(-1)
            right += int((predicted == k).sum())
            tokens += predicted.numel()
    assert 0.5 < right / tokens < 1
    assert a.entry["held_out"]["token_accuracy"] == pytest.approx(right / tokens)
    assert a.entry["held_out"]["tokens"] == tokens
