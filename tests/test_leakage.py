"""The leakage check of hf-darts on a folder the real pipeline calibrated: prompts cut by
`max_length` are matched only through full 13-token windows, never as a whole."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from lm_eval.api.instance import Instance
from safetensors.torch import load_file, save_file
from tiny import surgery_block
from transformers import AutoTokenizer

from lm_eval_darts.leakage import LeakageCheck
from mergekit_darts.errors import ReportError, SurgeryFormatError
from mergekit_darts.folder.manifest import surgery_dir
from mergekit_darts.hosts.post_merge import run_surgery
from mergekit_darts.present.report import write_report

# Requests that share only the first words of calibration prompts ("question :", "def add",
# "the sun", "repeat the"), and one that holds a whole prompt ("the sun and the moon").
UNRELATED = [
    "question : what colour is the sky",
    "def add_one ( n ) : pass",
    "the sun is a star",
    "repeat the question",
]
WHOLE = "say the sun and the moon twice"


def calibrated(merged: Path, data: Path, folder: Path, max_length: int) -> Path:
    shutil.copytree(merged, folder)
    block = surgery_block(
        data.parent / "math", data / "math.jsonl", calibration={"max_length": max_length}, steps=2
    )
    run_surgery(folder, block, progress=False, write_card=False)
    return surgery_dir(folder)


def overlaps(surgery: Path, texts: list[str]) -> int:
    check = LeakageCheck(AutoTokenizer.from_pretrained(surgery.parent))
    requests = [
        Instance("generate_until", {}, (text, {}), index, ("darts_task", index, 1))
        for index, text in enumerate(texts)
    ]
    check.check(requests, surgery, lambda task: "math")
    return check.counts.get("darts_task", 0)


@pytest.fixture(scope="module")
def folders(tiny_merged, calibration_data, tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("leakage")
    return {n: calibrated(tiny_merged, calibration_data, root / str(n), n) for n in (3, 512)}


@pytest.mark.slow
def test_cut_prompts_do_not_match_unrelated_requests(folders):
    assert overlaps(folders[3], UNRELATED) == 0
    assert overlaps(folders[3], [WHOLE]) == 0  # its 2-word head is no evidence either


@pytest.mark.slow
def test_whole_prompts_that_were_not_cut_still_match(folders):
    assert overlaps(folders[512], UNRELATED) == 0
    assert overlaps(folders[512], [WHOLE]) == 1


def test_a_shared_chat_frame_is_not_leakage_but_a_calibration_prompt_still_is():
    """Real chat prompts share a template + instruction longer than 13 tokens (SmolLM2's
    `make demo-real`: every request of every task was flagged). Ids stand for tokens."""
    from lm_eval_darts.leakage import CalibrationGrams

    frame = list(range(100, 116))  # 16 tokens every prompt of the task carries
    prompts = [frame + [1, 2, 3, 4, 5], frame + [6, 7, 8, 9, 10], frame + [11, 12, 13, 14, 15]]
    grams = CalibrationGrams(prompts)
    assert not grams.found_in(frame + [20, 21, 22, 23, 24])  # another prompt of the same task
    # ... also when it starts or ends like a calibration prompt (a window of frame + one word
    # matched half of SmolLM2's disjoint evaluation prompts)
    assert not grams.found_in(frame + [1, 21, 22, 23, 24])
    assert not grams.found_in([1, 2, 3] + frame + [6, 7, 8, 9, 11])
    assert all(grams.found_in(p) for p in prompts)  # the calibration prompts themselves
    assert grams.found_in([50, 51] + prompts[1] + [52])  # one inside a longer request
    alone = CalibrationGrams(prompts[:1])  # one prompt: nothing is a shared frame
    assert alone.found_in(frame + [20, 21, 22, 23, 24])


def test_a_framed_prompt_with_long_content_matches_through_its_own_windows():
    """Content of 13 tokens or more: any 13 of its own tokens in a row are evidence, with or
    without the frame around them; a suffix frame is cut off like a prefix."""
    from lm_eval_darts.leakage import CalibrationGrams

    head, tail = list(range(100, 116)), [200, 201, 202]
    content = [list(range(k * 20, k * 20 + 15)) for k in range(1, 4)]  # 15 tokens each
    grams = CalibrationGrams([head + c + tail for c in content])
    assert grams.found_in(content[1][:13])  # 13 of its own tokens, no frame
    assert not grams.found_in(content[1][:12] + tail)  # 12 of them + the frame
    assert not grams.found_in(head[-1:] + content[1][:12])


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["cut", "no mask"])
def test_an_unreadable_diagnostics_file_is_one_line(folders, tmp_path, damage):
    surgery = Path(shutil.copytree(folders[512].parent, tmp_path / "merged")) / "surgery"
    (path,) = (surgery / "diagnostics").glob("*.safetensors")
    if damage == "cut":
        path.write_bytes(path.read_bytes()[:100])
    else:
        tensors = load_file(path)
        tensors.pop("mask")
        save_file(tensors, path)
    with pytest.raises(SurgeryFormatError) as err:
        overlaps(surgery, [WHOLE])
    message = str(err.value)
    assert (
        message.startswith(f"{path} is not a readable diagnostics file (") and "\n" not in message
    )
    assert "re-run `mergekit-darts calibrate`" in message
    with pytest.raises(ReportError) as err:
        write_report(surgery.parent, output=tmp_path / "report", progress=False)
    assert str(err.value).startswith(f"{path} is not a") and "--recompute" in str(err.value)
