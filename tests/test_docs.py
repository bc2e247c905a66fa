"""The docs are true of the code: the README is short, starts with its two set-up commands and its
first YAML is the default; every relative link resolves; docs/surgery-block.md states the schema's
defaults; docs/demo.md holds the table `make demo` prints."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: Path) -> str:
    """The page without fenced code blocks (a link inside code is not a link)."""
    return re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped except - and _, spaces to -."""
    found = set()
    for line in _prose(path).splitlines():
        if heading := re.match(r"#+\s+(.*)", line):
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return found


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(page)):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme():
    readme = _prose(ROOT / "README.md")
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(readme)}
    assert {p.name for p in PAGES[1:]} <= linked


def test_readme_reads_in_minutes_and_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 160  # about 150 lines: a newcomer's five minutes
    first_block = re.search(r"```(?:sh|bash)?\n(.*?)```", text, flags=re.S).group(1)
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert [c.split("#")[0].strip() for c in commands] == ["make demo", "make test"]


# --- docs/surgery-block.md states the schema's defaults -------------------------------------------

SURGERY_BLOCK = ROOT / "docs" / "surgery-block.md"


def _sections(path: Path) -> dict[str, str]:
    """Each heading's text up to the next heading of any level."""
    parts = re.split(r"^#+\s+(.*)\n", path.read_text(encoding="utf-8"), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def _default_rows(section: str) -> list[tuple[str, str, str]]:
    """(key, default, meaning) cells of the section's `| key | default | meaning |` table."""
    table = re.search(r"^\| key \| default \| meaning \|\n\|[-| ]+\|\n((?:\|.*\n)+)", section, re.M)
    assert table, "no key / default / meaning table"
    rows = []
    for line in table.group(1).splitlines():
        rows.append(tuple(c.strip() for c in line.strip("|").split(" | ", 2)))
    return rows


def _minimal_block(**block):
    from mergekit_darts.config.schema import SurgeryConfig

    tasks = [{"name": n, "target": f"./{n}", "calibration": {"path": "p.jsonl"}} for n in "ab"]
    return SurgeryConfig.model_validate({"tasks": tasks, **block})


def _field_text_is_read(tmp_path: Path) -> bool:
    from mergekit_darts.calibrate.data import read_prompts
    from mergekit_darts.config.schema import CalibrationConfig

    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "not this", "text": "this"}\n')
    return read_prompts(CalibrationConfig(path=str(path)), "k", "t").texts == ("this",)


def _worded_defaults(tmp_path: Path) -> dict[tuple[str, str], tuple[str, bool]]:
    """Defaults the doc states in words, or that a later step fills in where the schema holds
    None: (class, key) -> (what the doc must say, whether the code does that)."""
    from mergekit_darts.config.resolve import resolve_tasks, route_tasks
    from mergekit_darts.config.schema import VERDICT_METRICS, SelectConfig

    plain = resolve_tasks(_minimal_block())[0]
    return {
        ("SurgeryConfig", "select"): (
            "the verdict",
            plain.select_default and plain.select.metric in VERDICT_METRICS,
        ),
        ("TaskConfig", "eval_tasks"): ("`[name]`", plain.eval_tasks == (plain.name,)),
        ("CalibrationConfig", "field"): ("`text`", _field_text_is_read(tmp_path)),
        ("SelectConfig", "candidates"): ("the six below", len(SelectConfig().candidates) == 6),
        ("RouteConfig", "tasks"): (
            "every task, in block order",
            route_tasks(_minimal_block(route={})) == ["a", "b"],
        ),
        ("SurgeryConfig", "joint"): (
            "every task, when it can be fitted",
            _joint_plan(_minimal_block()) == ("a", "b")
            and _joint_plan(_minimal_block(module="standard")) is None,
        ),
    }


def _joint_plan(config) -> tuple[str, ...] | None:
    from mergekit_darts.config.resolve import plan_joint, resolve_tasks

    plan = plan_joint(config, resolve_tasks(config))
    return None if plan is None else plan.tasks


def _stated_matches(model, key: str, stated: str, worded: dict) -> str | None:
    """Why the doc's default for ``model.key`` is not the code's, or None when it is."""
    import yaml

    field = model.model_fields[key]
    if (model.__name__, key) in worded:
        words, holds = worded[model.__name__, key]
        return None if stated == words and holds else f"says {stated!r}, expected {words!r}"
    if stated == "required":
        return None if field.is_required() else f"is not required (default {field.default!r})"
    if field.is_required():
        return f"is required, the doc says {stated!r}"
    actual = field.get_default(call_default_factory=True)
    if stated in ("none", "—", "block value"):
        return None if actual is None else f"defaults to {actual!r}, the doc says {stated!r}"
    literal = re.fullmatch(r"`([^`]+)`", stated)
    if not literal:
        return f"the doc's default {stated!r} is neither a `literal` nor a phrase this test knows"
    value = yaml.safe_load(literal.group(1))
    if actual == value and type(actual) is type(value):
        return None
    return f"defaults to {actual!r}, the doc says {value!r}"


def test_every_default_in_surgery_block_md_is_the_schemas(tmp_path):
    from mergekit_darts.config import schema

    tables = {  # the doc's section -> the schema class whose defaults its table states
        "Block-level keys": schema.SurgeryConfig,
        "Task keys": schema.TaskConfig,
        "Calibration keys": schema.CalibrationConfig,
        "Held-out metrics and `select`": schema.SelectConfig,
        "Routing: one model for every task": schema.RouteConfig,
    }
    sections, worded = _sections(SURGERY_BLOCK), _worded_defaults(tmp_path)
    wrong, documented = [], {}
    for heading, model in tables.items():
        documented[model] = set()
        for cell, stated, _ in _default_rows(sections[heading]):
            if cell.endswith("(default)"):  # spells out the default of the row above it
                continue
            for key in re.findall(r"`(\w+)`", cell):
                documented[model].add(key)
                if key not in model.model_fields:
                    wrong.append(f"{heading}: {key} is no key of {model.__name__}")
                elif why := _stated_matches(model, key, stated, worded):
                    wrong.append(f"{heading}: {key} {why}")
        missing = set(model.model_fields) - documented[model]
        assert not missing, f"{heading} leaves out {sorted(missing)}"
    assert not wrong, wrong


def test_the_default_candidates_are_the_ones_surgery_block_md_lists():
    import yaml

    from mergekit_darts.config.schema import SelectConfig

    rows = _default_rows(_sections(SURGERY_BLOCK)["Held-out metrics and `select`"])
    (meaning,) = [m for cell, _, m in rows if cell == "`candidates` (default)"]
    listed = yaml.safe_load(re.search(r"`(\[.*\])`", meaning).group(1))
    assert listed == [c.model_dump(exclude_none=True) for c in SelectConfig().candidates]


def _yaml_default_comments(text: str):
    """(key path, stated default) of every `key: value  # ... (default X)` in the YAML blocks."""
    for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.S):
        stack: list[tuple[int, str]] = []
        for line in block.splitlines():
            if not (entry := re.match(r"(\s*(?:- )?)(\w+):", line)):
                continue
            indent, key = len(entry.group(1)), entry.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            if stated := re.search(r"#.*\(default ([^()]+)\)", line):
                yield [k for _, k in stack] + [key], stated.group(1)
            stack.append((indent, key))


def test_defaults_in_the_yaml_comments_of_surgery_block_md_are_the_schemas(tmp_path):
    from mergekit_darts.config import schema

    owners = {  # where a key path of the examples is read
        ("surgery",): schema.SurgeryConfig,
        ("surgery", "select"): schema.SelectConfig,
        ("surgery", "route"): schema.RouteConfig,
        ("surgery", "route", "background"): schema.CalibrationConfig,
        ("surgery", "tasks"): schema.TaskConfig,
        ("surgery", "tasks", "calibration"): schema.CalibrationConfig,
    }
    worded = _worded_defaults(tmp_path)
    stated = list(_yaml_default_comments(SURGERY_BLOCK.read_text(encoding="utf-8")))
    assert len(stated) >= 3  # the select example states holdout, metric and refit
    wrong = []
    for path, value in stated:
        model = owners[tuple(path[:-1])]
        if why := _stated_matches(model, path[-1], f"`{value.strip('`')}`", worded):
            wrong.append(f"{'.'.join(path)} {why}")
    assert not wrong, wrong


def test_the_readmes_first_yaml_is_the_default_held_out_verdict():
    import yaml

    from mergekit_darts.config.resolve import resolve_tasks
    from mergekit_darts.config.schema import SurgeryConfig

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = yaml.safe_load(re.search(r"```yaml\n(.*?)```", text, flags=re.S).group(1))["surgery"]
    assert all(t.select_default for t in resolve_tasks(SurgeryConfig.model_validate(block)))


# --- the demo's table, as `make demo` prints it ---------------------------------------------------

DEMO_TABLE = re.compile(
    r"((?:^\|.*\n)+)\n((?:^\|.*\n)+)\n`sha256sum runs/demo/table\.md` → `([0-9a-f]{64})`", re.M
)


def test_docs_demo_md_holds_the_table_make_demo_prints():
    """The two tables before the stated sha256 are `runs/demo/table.md` byte for byte."""
    import hashlib

    shown = DEMO_TABLE.search((ROOT / "docs" / "demo.md").read_text(encoding="utf-8"))
    assert shown, "docs/demo.md has no table followed by `sha256sum runs/demo/table.md` → `...`"
    table = shown.group(1) + "\n" + shown.group(2)
    assert len(table.splitlines()) >= 30  # the headline rows of four merges and the shift table
    assert hashlib.sha256(table.encode()).hexdigest() == shown.group(3)
    printed = ROOT / "runs" / "demo" / "table.md"
    if printed.exists():  # after a `make demo` here: what it printed, unless the code changed it
        assert printed.read_text(encoding="utf-8") == table, "re-run make demo and copy its table"
