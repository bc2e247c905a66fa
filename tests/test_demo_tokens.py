"""Per-token accuracy of the long demo (demo.evaluation.token_accuracy), against a plain-Python
reference written here: the answer's tokens that the generation has at the same position, both
cut and stripped the way exact match sees them."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import tiny

from demo.domains import DOMAIN_NAMES, Example, Splits
from demo.evaluation import DemoSettings, evaluate, token_accuracy
from demo.family_io import family_paths, write_data, write_tasks

END = "<|im_end|>"
ANSWER = '{"name": "cat", "colour": "red", "city": "moon"}\n12\n34\n78\n56'


def reference_share(tokenizer: Any, answer: str, generation: str, stops: list[str]) -> float:
    """Cut at the first stop string, strip surrounding whitespace, count equal positions."""
    cut = min([generation.find(s) for s in stops if s in generation], default=len(generation))
    a = tokenizer(answer.strip(), add_special_tokens=False)["input_ids"]
    g = tokenizer(generation[:cut].strip(), add_special_tokens=False)["input_ids"]
    same = 0
    for i, token in enumerate(a):
        if i < len(g) and g[i] == token:
            same += 1
    return same / len(a)


def _sample(doc_id: int, target: str, generation: str, until: list[str]) -> dict[str, Any]:
    """One item as lm-eval's evaluator logs a generate_until request (`--log_samples`)."""
    gen_kwargs = {"until": until, "do_sample": False, "max_gen_toks": 80}
    return {
        "doc_id": doc_id,
        "target": target,
        "arguments": [("prompt", gen_kwargs)],
        "resps": [[generation]],
        "filtered_resps": [generation],
    }


def test_per_token_accuracy_matches_a_plain_python_reference() -> None:
    tokenizer = tiny.build_bpe_tokenizer()
    lines = ANSWER.split("\n")
    generations = [
        ANSWER + END + "more text after the turn",  # all of it
        "\n  " + ANSWER + "  \n" + END,  # whitespace around: stripped as exact match strips it
        "\n".join(lines[:3]),  # stopped halfway
        ANSWER.replace("78", "99"),  # one number wrong
        "Sure!\n" + ANSWER,  # a line first: everything shifted
        "",  # nothing
        ANSWER + "\n90\n91",  # longer than the answer: only the answer's positions count
        ANSWER.replace("\n56", "\n\n56"),  # cut by the second stop string
    ]
    until = [END, "\n\n"]
    samples = [_sample(i, ANSWER, g, until) for i, g in enumerate(generations)]
    random.Random(0).shuffle(samples)  # lm-eval's order is not the documents'
    shares = token_accuracy(samples, tokenizer)
    expected = [reference_share(tokenizer, ANSWER, g, until) for g in generations]
    assert shares == expected
    assert shares[0] == shares[1] == shares[6] == 1.0 and shares[5] == 0.0
    assert all(0 < shares[i] < 1 for i in (2, 3, 4, 7))
    assert shares[3] > shares[2]  # one token off keeps the rest in place


@pytest.mark.slow
def test_evaluate_measures_per_token_accuracy_on_the_long_scale_only(tiny_family, tmp_path):
    """Real lm-eval (`hf` on a tiny random model, the demo's task files): the generations of a
    first run become answers, whole or changed, so the second run's shares are known."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    family = replace(family_paths(tmp_path / "family"), base=tiny_family.base)
    tokenizer = tiny.build_tokenizer()
    prompts = ["repeat cat dog sun", "reverse moon tree", "print one two three", "if x then y"]
    stop = "?"

    def write(answers: list[str]) -> None:
        items = tuple(Example(p, a) for p, a in zip(prompts, answers, strict=True))
        write_data(family, {d: Splits(calib=items[:1], eval=items) for d in DOMAIN_NAMES})
        write_tasks(family, stop, 6)

    write(["cat"] * len(prompts))
    model_args = f"pretrained={tiny_family.base},dtype=float32"
    output = lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args,
        tasks=[f"demo_{d}" for d in DOMAIN_NAMES],
        task_manager=TaskManager(include_path=str(family.tasks)),
        batch_size=32,
        device="cpu",
        log_samples=True,
    )
    samples = sorted(output["samples"]["demo_code"], key=lambda s: s["doc_id"])
    said = [s["filtered_resps"][0].split(stop)[0].strip() for s in samples]
    assert all(said), said  # the model says something to build answers from
    words = [s.split() for s in said]
    answers = [
        said[0],  # all of it
        " ".join([*words[1][:1], "zero", *words[1][2:]]),  # its second word changed
        " ".join(words[2][: max(1, len(words[2]) // 2)] + ["zero"] * 3),  # half, then wrong
        "zero " + said[3],  # shifted by one word
    ]
    write(answers)
    expected = [
        reference_share(tokenizer, a, g, [stop]) for a, g in zip(answers, said, strict=True)
    ]
    assert expected[0] == 1.0 and expected[-1] < 1.0

    settings = DemoSettings(out=tmp_path / "demo", scale="real")
    real = evaluate(settings, family, "hf", model_args, "key")
    assert real.tokens == {}  # the tiny and real scales keep their evaluations as they were
    long = evaluate(replace(settings, scale="long"), family, "hf", model_args, "key")
    assert long.tokens == {d: expected for d in DOMAIN_NAMES}  # the cache without it: run again
    assert long.items == real.items
    assert evaluate(replace(settings, scale="long"), family, "hf", model_args, "key") == long
