"""What a surgery run leaves in the merged folder, by name: every file name lives here.

``<merged>/surgery/`` holds one safetensors file per task, ``manifest.json`` (settings, prompt
hashes, metrics, timings), the block as run (``surgery.yml``), per-task diagnostics and, once
``mergekit-darts report`` ran, the report. The YAML key of the block is ``surgery`` too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from mergekit_darts.correction.darts_correction import PLAIN_KINDS
from mergekit_darts.correction.spec import ModuleSpec
from mergekit_darts.errors import SurgeryFormatError
from mergekit_darts.messages import describe_error
from mergekit_darts.task_map import check_task_name

BLOCK_KEY = "surgery"  # the merge YAML's key for the block
SURGERY_DIR = "surgery"  # the folder inside a merged model
MANIFEST = "manifest.json"
SURGERY_YAML = "surgery.yml"  # the block as it was run
REPORT_DIR = "report"  # inside surgery/: replaced together with the modules it describes
ROUTER = "router.safetensors"  # the gate of ``route:`` (``weight`` [K', H], ``bias`` [K'])
JOINT_FILE = "joint.safetensors"  # the joint correction of every task (calibrate.joint)
RECIPE = "mergekit_config.yml"  # mergekit's record of the merge
FORMAT = "darts-surgery"
SHA256 = r"^[0-9a-f]{64}$"  # a file's sha256, as the manifest records it
VERSION = 1


def surgery_dir(merged: str | Path) -> Path:
    """``<merged>/surgery``."""
    return Path(merged) / SURGERY_DIR


def module_file(task: str) -> str:
    """The task's module, relative to ``surgery/``."""
    return f"{task}.safetensors"


def diagnostics_file(task: str) -> str:
    """The task's diagnostics (Figure 1's data), relative to ``surgery/``."""
    return f"diagnostics/{task}.safetensors"


def plain_file_name(name: str) -> str:
    """``name``, or ``ValueError`` unless it names a file directly inside ``surgery/``: manifests
    travel with downloaded merges, and no name in one may lead elsewhere."""
    if PurePosixPath(name).name != name or name in ("", ".", "..") or "\\" in name:
        raise ValueError(f"{name!r} must be a plain file name inside surgery/")
    return name


def relative_file_name(name: str) -> str:
    """``name``, or ``ValueError`` unless it names a file inside ``surgery/`` or a folder of it
    (``diagnostics/<task>.safetensors``), for the same reason."""
    parts = PurePosixPath(name).parts
    if "\\" in name or name.startswith("/") or ".." in parts or not parts:
        raise ValueError(f"{name!r} must be a relative path inside surgery/")
    return name


class _Record(BaseModel):
    """Typed where code reads a key, open where it does not: unknown keys round-trip unchanged."""

    model_config = ConfigDict(extra="allow")

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: keys in the order written, absent optional keys left out."""
        return self.model_dump(mode="json", exclude_none=True)


class TaskEntry(ModuleSpec, _Record):
    """One task's module (its :class:`ModuleSpec`, what ``load_surgery`` builds), what it serves,
    and how it was made."""

    loss: str | None = None
    steps: int | None = None
    lr: float | None = None
    batch_size: int | None = None
    seed: int | None = None
    loss_positions: str | None = None
    target: str | None = None
    eval_tasks: list[str] = Field(default_factory=list)
    calibration: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, Any] = Field(default_factory=dict)
    timings: dict[str, float] = Field(default_factory=dict)
    diagnostics: str | None = None
    held_out: dict[str, Any] | None = None
    selection: dict[str, Any] | None = None
    file: str | None = None  # filled in by the writer: the module's file inside surgery/
    sha256: str | None = Field(default=None, pattern=SHA256)  # of ``file``; see artifacts

    @field_validator("file")
    @classmethod
    def _plain_file(cls, name: str | None) -> str | None:
        return None if name is None else plain_file_name(name)

    @field_validator("diagnostics")
    @classmethod
    def _inside_surgery(cls, name: str | None) -> str | None:
        return None if name is None else relative_file_name(name)

    def served(self, name: str) -> list[str]:
        """The lm-eval tasks this module serves: ``eval_tasks``, or its own name."""
        return list(self.eval_tasks) or [name]


class RouterEntry(_Record):
    """``route:``'s gate: the tasks it weighs (in gate order), whether a last "none" class was
    fitted on background text, and how well it picks the task on held-out prompts."""

    tasks: list[str] = Field(min_length=2)
    background: bool = False
    file: str = ROUTER
    sha256: str | None = Field(default=None, pattern=SHA256)  # of ``file``; see artifacts
    held_out: dict[str, Any] | None = None

    @field_validator("tasks")
    @classmethod
    def _task_names(cls, tasks: list[str]) -> list[str]:
        for name in tasks:
            check_task_name(name)
        if len(set(tasks)) != len(tasks):
            raise ValueError(f"lists a task twice: {tasks}")
        return tasks

    @field_validator("file")
    @classmethod
    def _plain_file(cls, name: str) -> str:
        return plain_file_name(name)

    @property
    def classes(self) -> list[str]:
        """Gate classes in order: the tasks, then "none" when fitted with background."""
        return [*self.tasks, *(["none"] if self.background else [])]


class JointEntry(ModuleSpec, _Record):
    """The joint correction: one plain correction fitted on every task's prompts (``module``
    none when the verdict kept none), the tasks it was judged on, and its verdict."""

    loss: str | None = None
    tasks: list[str] = Field(min_length=2)
    selection: dict[str, Any] = Field(default_factory=dict)
    timings: dict[str, float] = Field(default_factory=dict)
    file: str = JOINT_FILE
    sha256: str | None = Field(default=None, pattern=SHA256)  # of ``file``; see artifacts

    @field_validator("module")
    @classmethod
    def _plain_kind(cls, kind: str) -> str:
        if kind not in (*PLAIN_KINDS, "none"):
            raise ValueError(f"a joint correction is plain ({', '.join(PLAIN_KINDS)}) or none")
        return kind

    @field_validator("tasks")
    @classmethod
    def _task_names(cls, tasks: list[str]) -> list[str]:
        for name in tasks:
            check_task_name(name)
        return tasks

    @field_validator("file")
    @classmethod
    def _plain_file(cls, name: str) -> str:
        return plain_file_name(name)


class Manifest(_Record):
    """``surgery/manifest.json``: shared facts about the run, and one :class:`TaskEntry` per task."""

    format: Literal[FORMAT] = FORMAT
    version: Literal[VERSION] = VERSION
    hidden_size: int
    vocab_size: int | None = None
    config: str | None = None  # the block as run, relative to surgery/
    device: str | None = None
    cache_dtype: str | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    timings: dict[str, float] = Field(default_factory=dict)
    captures: dict[str, int] = Field(default_factory=dict)
    # mergekit_darts.folder.identity.weights_identity of the weights calibrated on; None: a manifest
    # written before it was recorded (or by hand), which loaders accept unchecked
    merged_identity: str | None = None
    tasks: dict[str, TaskEntry]
    router: RouterEntry | None = None  # present when the block had ``route:``
    joint: JointEntry | None = None  # present when the block fitted a joint correction

    @field_validator("format", mode="before")
    @classmethod
    def _format(cls, value: Any) -> Any:
        if value != FORMAT:
            raise ValueError(f"{value!r} is not a {FORMAT!r} manifest")
        return value

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, value: Any) -> Any:
        if value != VERSION:
            raise ValueError(
                f"format version {value!r}, this package reads version {VERSION}: upgrade "
                "mergekit-darts or re-run the surgery"
            )
        return value

    @field_validator("config")
    @classmethod
    def _plain_config(cls, name: str | None) -> str | None:
        return None if name is None else plain_file_name(name)

    @field_validator("tasks")
    @classmethod
    def _task_names(cls, tasks: dict[str, TaskEntry]) -> dict[str, TaskEntry]:
        for name, entry in tasks.items():
            check_task_name(name)
            # the writer names each file after its task: an entry may not serve another's module
            if entry.file not in (None, module_file(name)):
                raise ValueError(
                    f"task {name!r} names file {entry.file!r}, not its own {module_file(name)!r}"
                )
        return tasks

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = MANIFEST) -> Manifest:
        """Validate ``data``; a problem is one line naming ``where`` and the key."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as err:
            raise SurgeryFormatError(f"{where}: {describe_error(err, cls, 'manifest')}") from None
