"""The demo's Figure 1 over prompt + answer (demo.position_study) on a tiny three-expert merge made
by the real mergekit and surgery, against float64 hidden states and module math written here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny import PROMPTS, build_tokenizer, hooked_merge, save_model
from transformers import LlamaForCausalLM

from demo.configs import VARIANTS, merge_config
from demo.domains import DOMAIN_NAMES
from demo.family_io import family_paths, write_tasks
from demo.position_study import (
    BEFORE,
    DomainBias,
    answer_aligned,
    position_bias,
    position_figures,
    summarize,
)
from mergekit_darts.errors import DartsError

LIMIT = 46  # answer tokens: past the DARTS table (prompts, 14 tokens at most) and the
# +completions one (prompt + 32)
CURVE_TASKS = {"Standard + L1": "_std", "DARTS": "", "DARTS +completions": "_cont"}
EOS = 3  # tiny.tiny_config's eos_token_id


@pytest.fixture(scope="module")
def family(tiny_family, tmp_path_factory: pytest.TempPathFactory):
    """The demo's family layout over the tiny models: code, math and a third noisy expert,
    calibration prompts and disjoint evaluation prompts per domain."""
    root = tmp_path_factory.mktemp("position_family")
    paths = family_paths(root)
    paths = type(paths)(root, tiny_family.base, paths.experts, paths.data, paths.tasks)
    base = LlamaForCausalLM.from_pretrained(tiny_family.base)
    save_model(paths.experts["instruct"], build_tokenizer(), seed=3, base=base, noise=0.3)
    for name in ("code", "math"):
        paths.experts[name].parent.mkdir(parents=True, exist_ok=True)
        paths.experts[name].symlink_to(getattr(tiny_family, name))
    paths.data.mkdir()
    write_tasks(paths, "</s>", LIMIT)  # the evaluation's generation limit: the study's default
    for i, domain in enumerate(DOMAIN_NAMES):
        calib = PROMPTS[i : i + 6]
        held_out = [p for p in PROMPTS if p not in calib][:5]
        for file, texts in ((paths.calib_file(domain), calib), (paths.eval_file(domain), held_out)):
            file.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return paths


@pytest.fixture(scope="module")
def merged(family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """task_arithmetic of the three experts with the demo's Standard + L1, DARTS and DARTS
    +completions tasks per domain (demo.configs), by the real mergekit and surgery."""
    rows = tuple(v for v in VARIANTS if v.suffix in CURVE_TASKS.values())
    calib = {d: family.calib_file(d) for d in DOMAIN_NAMES}
    config = merge_config(
        "task_arithmetic", family.base, family.experts, calib, steps=20, rows=rows
    )
    out = tmp_path_factory.mktemp("position_merge") / "task_arithmetic"
    hooked_merge(config, out)
    return out


@pytest.fixture(scope="module")
def study(merged, family) -> dict[str, DomainBias]:
    return position_bias(merged, family, num_samples=5)


def _hidden(folder: Path, ids: list[int]) -> torch.Tensor:
    """Final hidden states (after the last norm) [T, H] in float64, one unpadded sequence."""
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def _logits(folder: Path, ids: list[int]) -> torch.Tensor:
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def _corrected(h: torch.Tensor, tensors: dict[str, torch.Tensor], table: bool) -> torch.Tensor:
    """Paper eq. 3/4 by hand: h − W_up ReLU(W_down h) (− b_t for every row of the table)."""
    down, up = tensors["down.weight"].double(), tensors["up.weight"].double()
    out = h - torch.relu(h @ down.T) @ up.T
    if table and "position_bias" in tensors:
        bias = tensors["position_bias"].double()
        rows = min(h.shape[0], bias.shape[0])
        out[:rows] -= bias[:rows]
    return out


def test_sequences_are_each_prompt_then_the_experts_greedy_answer(study, family, merged):
    tokenizer = build_tokenizer()
    for domain, bias in study.items():
        prompts = [json.loads(line)["prompt"] for line in family.eval_file(domain).open()]
        assert len(bias.sequences) == len(prompts) == bias.mask.shape[0]
        for row, (text, ids) in enumerate(zip(prompts, bias.sequences, strict=True)):
            prompt = tokenizer(text)["input_ids"]
            assert ids[: len(prompt)] == prompt
            answer = ids[len(prompt) :]
            assert answer and EOS not in answer and len(answer) <= LIMIT
            logits = _logits(family.experts[domain], ids)
            # each answer token is the expert's argmax after the tokens before it
            assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == answer
            if len(answer) < LIMIT:  # the expert stopped: its next token is the end
                assert int(logits[-1].argmax()) == EOS
            assert bias.mask[row].sum() == len(ids)
            assert bias.completion[row].tolist() == [
                len(prompt) <= t < len(ids) for t in range(bias.mask.shape[1])
            ]


def test_delta_before_and_after_each_module_match_a_float64_reference(study, family, merged):
    surgery = merged / "surgery"
    manifest = json.loads((surgery / "manifest.json").read_text())
    checked_past_table = 0
    for domain, bias in study.items():
        assert list(bias.delta) == [BEFORE, *CURVE_TASKS]
        tensors = {
            label: load_file(surgery / f"{domain}{suffix}.safetensors")
            for label, suffix in CURVE_TASKS.items()
        }
        for label in ("DARTS", "DARTS +completions"):
            # the table's reach is the longest calibrated sequence (prompt + completion)
            cal = manifest["tasks"][domain + CURVE_TASKS[label]]["calibration"]
            reach = max(
                p + c
                for p, c in zip(
                    cal["prompt_tokens"],
                    cal.get("completion_tokens", [0] * len(cal["prompt_tokens"])),
                    strict=True,
                )
            )
            assert bias.table_length[label] == reach < max(map(len, bias.sequences))
            table = tensors[label]["position_bias"]
            assert torch.count_nonzero(table[reach:]) == 0 and table[reach - 1].abs().sum() > 0
        assert set(bias.table_length) == {"DARTS", "DARTS +completions"}
        for row, ids in enumerate(bias.sequences):
            h_merged, h_expert = _hidden(merged, ids), _hidden(family.experts[domain], ids)
            width = len(ids)
            reference = (h_merged - h_expert).abs().mean(-1)
            np.testing.assert_allclose(
                bias.delta[BEFORE][row, :width], reference, rtol=1e-4, atol=1e-6
            )
            assert not bias.delta[BEFORE][row, width:].any()  # padding counts nothing
            for label, state in tensors.items():
                after = (_corrected(h_merged, state, table=True) - h_expert).abs().mean(-1)
                np.testing.assert_allclose(
                    bias.delta[label][row, :width], after, rtol=1e-4, atol=1e-6
                )
                if label not in bias.table_length:
                    continue
                # past the table: the content correction alone; inside it the table acts
                reach = bias.table_length[label]
                content = (_corrected(h_merged, state, table=False) - h_expert).abs().mean(-1)
                got = bias.delta[label][row, :width]
                np.testing.assert_allclose(got[reach:], content[reach:], rtol=1e-4, atol=1e-6)
                assert not np.allclose(got[:reach], content[:reach], rtol=1e-3, atol=1e-5)
                checked_past_table += width - reach
    assert checked_past_table > 0


def test_summary_means_match_the_per_token_values(study):
    early, late = 8, 40
    summary = summarize(study, early=early, late_from=late)
    for domain, bias in study.items():
        numbers = summary["domains"][domain]
        for label, delta in bias.delta.items():
            values = [
                [float(delta[r, t]) for t in range(len(ids)) if t < early]
                for r, ids in enumerate(bias.sequences)
            ]
            late_values = [
                float(delta[r, t])
                for r, ids in enumerate(bias.sequences)
                for t in range(late, len(ids))
            ]
            flat = [v for row in values for v in row]
            curve = numbers["curves"][label]
            assert curve["early"] == pytest.approx(sum(flat) / len(flat), rel=1e-9)
            assert curve["late"] == pytest.approx(sum(late_values) / len(late_values), rel=1e-9)
            assert curve["late_over_early"] == pytest.approx(curve["late"] / curve["early"])
        assert numbers["samples_reaching_late"] == sum(len(ids) > late for ids in bias.sequences)
        before = bias.delta[BEFORE]
        reach = bias.table_length["DARTS"]
        past = [(r, t) for r, ids in enumerate(bias.sequences) for t in range(reach, len(ids))]
        after = bias.delta["DARTS +completions"]
        rho = 1 - sum(after[r, t] for r, t in past) / sum(before[r, t] for r, t in past)
        cont = numbers["curves"]["DARTS +completions"]["rho_l1_past_darts_table"]
        assert cont == pytest.approx(rho, rel=1e-6)


def test_answer_aligned_means_match_the_per_token_values(study):
    for bias in study.values():
        delta = bias.delta[BEFORE]
        offsets, mean, counts = answer_aligned(delta, bias)
        by_offset: dict[int, list[float]] = {}
        for r, ids in enumerate(bias.sequences):
            start = int(bias.completion[r].tolist().index(True))
            for t in range(len(ids)):
                by_offset.setdefault(t - start, []).append(float(delta[r, t]))
        assert offsets.tolist() == list(range(min(by_offset), max(by_offset) + 1))
        for i, offset in enumerate(offsets.tolist()):
            values = by_offset.get(offset, [])
            assert counts[i] == len(values)
            if values:
                assert mean[i] == pytest.approx(sum(values) / len(values), rel=1e-9)


def test_position_figures_writes_the_plot_and_summary(study, family, merged, tmp_path, monkeypatch):
    import demo.position_study as module

    monkeypatch.setattr(module, "position_bias", lambda *a, **k: study)  # computed above
    paths = position_figures(tmp_path, merged, family)
    assert [p.name for p in paths] == [f"{merged.name}_position_bias.{s}" for s in module.SUFFIXES]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(paths[1].read_text())
    assert set(summary["domains"]) == set(DOMAIN_NAMES)
    text = paths[2].read_text()
    assert all(f"### {d} " in text for d in DOMAIN_NAMES)


def test_bad_inputs_fail_in_one_line_before_any_model_loads(family, merged, tiny_merged, tmp_path):
    broken = type(family)(
        family.root, family.base, family.experts, tmp_path / "nowhere", family.tasks
    )
    for folder, fam, words in (
        (tiny_merged, family, "manifest"),
        (merged, broken, "no file"),
    ):
        with pytest.raises(DartsError) as info:
            position_figures(tmp_path / "out", folder, fam)
        assert "\n" not in str(info.value) and words in str(info.value)
    assert not (tmp_path / "out").exists()
    copy = Path(shutil.copytree(merged, tmp_path / "merged"))
    manifest = json.loads((copy / "surgery" / "manifest.json").read_text())
    del manifest["tasks"]["math_std"]
    (copy / "surgery" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DartsError, match="no task math_std"):
        position_bias(copy, family)
