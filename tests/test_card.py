"""The model card is updated after `surgery/` is in place, so a card that cannot be read as
expected is a warning, never a failed run (which would leave `surgery/` and refuse the next run)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
from tiny import surgery_block

from mergekit_darts.folder.manifest import Manifest
from mergekit_darts.hosts.post_merge import run_surgery
from mergekit_darts.present.card import START, update_model_card

pytestmark = pytest.mark.slow  # every test here trains, merges or starts a process

BAD_FRONT = "---\nlicense: [apache\ntags: x\n---\n# my merge\n\nwords\n"


def block(data: Path) -> dict:
    return surgery_block(data.parent / "math", data / "math.jsonl", steps=3)


@pytest.fixture(scope="module")
def calibrated(tiny_merged, calibration_data, tmp_path_factory) -> tuple[Path, Manifest]:
    """A merged folder whose README front matter is not YAML, calibrated by run_surgery."""
    folder = tmp_path_factory.mktemp("card") / "merged"
    shutil.copytree(tiny_merged, folder)
    (folder / "README.md").write_text(BAD_FRONT)
    written = run_surgery(folder, block(calibration_data), progress=False)
    return folder, Manifest.from_dict(written)


def test_front_matter_that_is_not_yaml_is_a_warning(calibrated, caplog):
    folder, manifest = calibrated
    assert (folder / "surgery" / "manifest.json").is_file()
    text = (folder / "README.md").read_text()
    assert text.startswith(BAD_FRONT.rstrip("\n")), "the front matter is left as it was"
    assert text.count(START) == 1
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        update_model_card(folder, manifest)
    warning = caplog.records[-1].getMessage()
    assert warning.startswith(f"{folder / 'README.md'}: its front matter is not valid YAML (")
    assert "the tags darts, representation-surgery are not" in warning
    assert (folder / "README.md").read_text().count(START) == 1


@pytest.mark.parametrize(
    ("front", "tags"),
    [
        ("tags: merge", ["merge", "darts", "representation-surgery"]),
        ("tags:\n- merge\n- darts", ["merge", "darts", "representation-surgery"]),
        ("license: mit", ["darts", "representation-surgery"]),
    ],
)
def test_tags_are_added_to_a_list(calibrated, tmp_path, front, tags):
    import yaml

    _, manifest = calibrated
    (tmp_path / "README.md").write_text(f"---\n{front}\n---\n# card\n")
    text = update_model_card(tmp_path, manifest).read_text()
    assert yaml.safe_load(text.split("---\n")[1])["tags"] == tags


@pytest.mark.parametrize("front", ["- a list", "tags: {a: 1}"])
def test_front_matter_without_room_for_tags_is_left_alone(calibrated, tmp_path, caplog, front):
    _, manifest = calibrated
    (tmp_path / "README.md").write_text(f"---\n{front}\n---\n# card\n")
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        text = update_model_card(tmp_path, manifest).read_text()
    assert text.startswith(f"---\n{front}\n---\n# card\n\n{START}")
    assert "its front matter" in caplog.records[-1].getMessage()


def test_recipe_mergekit_cannot_read_gives_a_bare_card(calibrated, tmp_path, caplog):
    _, manifest = calibrated
    (tmp_path / "mergekit_config.yml").write_text("merge_method: [unclosed\n")
    with caplog.at_level(logging.WARNING, logger="mergekit_darts"):
        text = update_model_card(tmp_path, manifest).read_text()
    assert text.startswith(f"# {tmp_path.name}\n\n{START}")
    assert "mergekit cannot rebuild its model card from it" in caplog.records[-1].getMessage()
