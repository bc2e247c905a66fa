"""Plain exports: a ``head`` or ``norm`` correction folded into the merge's own tensors, loaded by
stock transformers (no trust_remote_code, no missing or unexpected keys) on several decoder
architectures, tied and untied, computing what ``apply_surgery`` computes and what a float64
reference of the fold computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import random_module, write_surgery
from transformers import AutoConfig, AutoModelForCausalLM

from mergekit_darts import apply_surgery
from mergekit_darts.errors import ExportError
from mergekit_darts.hosts.deploy.export import export

VOCAB, HIDDEN = 96, 32
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
ARCHITECTURES = {
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-untied": ("qwen3", {"tie_word_embeddings": False, "head_dim": 8}),
    "gemma2": ("gemma2", {"head_dim": 8}),
    "phi3": ("phi3", {"tie_word_embeddings": False, "pad_token_id": 0}),
    # LayerNorm with a bias before an LM head with a bias
    "phi-untied": ("phi", {"tie_word_embeddings": False}),
    "phi-tied": ("phi", {"tie_word_embeddings": True}),
}


def build(folder: Path, name: str) -> Path:
    model_type, extra = ARCHITECTURES[name]
    config = AutoConfig.for_model(model_type, **SIZES, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():  # visibly non-trivial norm weights (Gemma's start at zero)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(0.5 * torch.randn(p.shape))
        head_bias = model.get_output_embeddings().bias
        if head_bias is not None:  # transformers starts it at zero: make it count
            head_bias.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    return folder


def corrected_folder(tmp_path: Path, name: str, kind: str) -> tuple[Path, Path]:
    merged = build(tmp_path / "merged", name)
    module = random_module(kind, HIDDEN, 4, 16, seed=3, scale=0.3)
    write_surgery(merged / "surgery", {kind: module}, entries={kind: {"eval_tasks": ["x"]}})
    return merged, tmp_path / "plain"


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


CASES = [(n, k) for n in ARCHITECTURES for k in ("head", "norm") if (n, k) != ("gemma2", "head")]


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_a_plain_export_is_the_corrected_merge_in_stock_transformers(
    tmp_path: Path, name: str, kind: str
) -> None:
    merged, dest = corrected_folder(tmp_path, name, kind)
    export(merged, dest, task=kind, link="copy")
    config = json.loads((dest / "config.json").read_text())
    source = json.loads((merged / "config.json").read_text())
    assert "auto_map" not in config and config["architectures"] == source["architectures"]
    assert not list(dest.glob("*.py"))
    model, info = AutoModelForCausalLM.from_pretrained(
        dest, dtype=torch.float32, output_loading_info=True
    )
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"]
    untied = kind == "head" and source.get("tie_word_embeddings", False)
    assert config.get("tie_word_embeddings", False) is (
        False if untied else source.get("tie_word_embeddings", False)
    )

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    reference = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    plain_logits = logits_of(reference, ids)
    apply_surgery(reference, merged / "surgery", kind)
    expected = logits_of(reference, ids)
    got = logits_of(model.eval(), ids)
    assert (got - expected).abs().max() <= 1e-4
    assert (expected - plain_logits).abs().max() > 1e-3  # the correction is really there


def test_the_head_fold_equals_a_float64_reference(tmp_path: Path) -> None:
    merged, dest = corrected_folder(tmp_path, "llama-tied", "head")
    export(merged, dest, task="head", link="copy")
    from safetensors.torch import load_file

    from mergekit_darts.folder.artifacts import load_surgery

    m = load_surgery(merged / "surgery", "head").weight.double()
    embed = load_file(merged / "model.safetensors")["model.embed_tokens.weight"].double()
    folded = load_file(dest / "model.safetensors")
    expected = embed @ (torch.eye(HIDDEN, dtype=torch.float64) - m)
    assert (folded["lm_head.weight"].double() - expected).abs().max() < 1e-6
    assert torch.equal(folded["model.embed_tokens.weight"].double(), embed)  # input side unchanged


def test_the_norm_fold_minds_a_one_plus_w_norm(tmp_path: Path) -> None:
    merged, dest = corrected_folder(tmp_path, "gemma2", "norm")
    export(merged, dest, task="norm", link="copy")
    from safetensors.torch import load_file

    from mergekit_darts.folder.artifacts import load_surgery

    scale = 1 - load_surgery(merged / "surgery", "norm").shift.double()
    w = load_file(merged / "model.safetensors")["model.norm.weight"].double()
    folded = load_file(dest / "model.safetensors")["model.norm.weight"].double()
    assert (folded - ((1 + w) * scale - 1)).abs().max() < 1e-6  # Gemma scales by (1 + w)


@pytest.mark.parametrize("name", ["phi-untied", "phi-tied"])
def test_phi_folds_keep_the_head_bias_and_scale_the_norm_bias(tmp_path: Path, name: str) -> None:
    """Phi's LM head has a bias and its final norm is a LayerNorm with one: the head fold is
    ``W (I - M)`` with the bias as it was, the norm fold ``g s`` and ``b s``; both in float64."""
    from safetensors.torch import load_file

    from mergekit_darts.folder.artifacts import load_surgery

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    for kind in ("head", "norm"):
        merged, dest = corrected_folder(tmp_path / kind, name, kind)
        export(merged, dest, task=kind, link="copy")
        module = load_surgery(merged / "surgery", kind)
        source = {k: v.double() for k, v in load_file(merged / "model.safetensors").items()}
        folded = {k: v.double() for k, v in load_file(dest / "model.safetensors").items()}
        tied = "lm_head.weight" not in source
        w = source["model.embed_tokens.weight" if tied else "lm_head.weight"]
        bias = source["lm_head.bias"]
        changed = {k for k in source if not torch.equal(source[k], folded[k])}
        if kind == "head":
            m = module.weight.double()
            expected = {"lm_head.weight": w @ (torch.eye(HIDDEN, dtype=torch.float64) - m)}
        else:
            s = 1 - module.shift.double()
            norm = "model.final_layernorm."
            expected = {n: source[n] * s for n in (norm + "weight", norm + "bias")}
        assert changed | (set(folded) - set(source)) == set(expected)
        for n, tensor in expected.items():
            assert (folded[n] - tensor).abs().max() < 1e-6, n
        assert torch.equal(folded["lm_head.bias"], bias)  # no shift: the head bias stays
        card = (dest / "README.md").read_text()
        assert ("head bias, as Phi's, is kept exactly" if kind == "head" else "bias, as") in card

        model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float64).eval()
        plain = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float64).eval()
        with torch.no_grad():
            h = model.model(input_ids=ids).last_hidden_state
            h = h - h @ m.T if kind == "head" else h * s
            reference = h @ w.T + bias
            error = (plain(input_ids=ids).logits - reference).abs().max()
            assert error <= 1e-4, (kind, float(error))
            assert (model(input_ids=ids).logits - reference).abs().max() > 1e-3


def test_head_is_refused_where_the_gguf_would_drop_the_untied_head(tmp_path: Path) -> None:
    merged, dest = corrected_folder(tmp_path, "gemma2", "head")
    with pytest.raises(ExportError, match="use module: norm") as err:
        export(merged, dest, task="head")
    assert "\n" not in str(err.value) and not dest.exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["head", "norm"])
def test_a_calibrated_plain_kind_exports_to_stock_transformers(
    tiny_family, calibration_data: Path, tiny_merged: Path, tmp_path: Path, kind: str
) -> None:
    import shutil

    from tiny import quick_block

    from mergekit_darts import run_surgery

    merged = Path(shutil.copytree(tiny_merged, tmp_path / "merged"))
    run_surgery(merged, quick_block(tiny_family, calibration_data, module=kind), progress=False)
    manifest = json.loads((merged / "surgery" / "manifest.json").read_text())
    assert manifest["tasks"]["math"]["module"] == kind
    export(merged, tmp_path / "plain", task="math")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    apply_surgery(reference, merged / "surgery", "math")
    ids = torch.randint(3, 60, (2, 10), generator=torch.Generator().manual_seed(2))
    assert (logits_of(model, ids) - logits_of(reference, ids)).abs().max() <= 1e-4


@pytest.mark.slow
def test_the_verdict_under_plain_true_judges_only_plain_candidates(
    tiny_family, calibration_data: Path, tiny_merged: Path, tmp_path: Path
) -> None:
    import shutil

    from tiny import quick_block

    from mergekit_darts import run_surgery

    merged = Path(shutil.copytree(tiny_merged, tmp_path / "merged"))
    run_surgery(merged, quick_block(tiny_family, calibration_data, plain=True), progress=False)
    entry = json.loads((merged / "surgery" / "manifest.json").read_text())["tasks"]["math"]
    judged = [c["module"] for c in entry["selection"]["candidates"]]
    assert judged == ["none", "head", "norm"] and entry["module"] in judged


def test_head_on_gemma_is_refused_before_merging(
    tiny_family, calibration_data: Path, tmp_path: Path
) -> None:
    from tiny import quick_block

    from mergekit_darts.config import parse_surgery, resolve_tasks
    from mergekit_darts.config.preflight import check_targets
    from mergekit_darts.errors import SurgeryConfigError

    gemma = build(tmp_path / "gemma", "gemma2")
    block = quick_block(tiny_family, calibration_data, module="head")
    block["tasks"][0]["target"] = str(gemma)
    tasks = resolve_tasks(parse_surgery(block))
    with pytest.raises(SurgeryConfigError) as err:
        check_targets(tasks, str(gemma), "base model", trust_remote_code=False, check_vocab=False)
    assert str(err.value).startswith("surgery.module: module head unties the LM head")
    assert "use module: norm" in str(err.value) and "\n" not in str(err.value)
    block["module"] = "norm"
    check_targets(
        resolve_tasks(parse_surgery(block)),
        str(gemma),
        "base model",
        trust_remote_code=False,
        check_vocab=False,
    )
