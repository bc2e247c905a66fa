"""Writes that readers never see half done: a temporary sibling, then one rename.

A file is written next to its final name and renamed over it (``os.replace`` is atomic on one
filesystem). A folder is filled in a staging sibling and swapped in whole; an existing folder is
moved aside first and removed only after the new one is in place. On any error the staging copy
is removed and what was there before stays.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def same_path(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` name one place, symlinks resolved (neither need exist)."""
    return Path(os.path.realpath(a)) == Path(os.path.realpath(b))


def inside(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` is ``folder`` or lies under it, symlinks resolved (neither need exist)."""
    path, folder = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return path == folder or folder in path.parents


def check_writable(folder: str | Path) -> None:
    """Raise the ``OSError`` that writing into the existing ``folder`` would raise, if any: a
    folder is made in it and removed again (permission bits say nothing to root, a read-only
    mount or an immutable folder)."""
    os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=folder))


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


@contextmanager
def atomic_file(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | Path, data: bytes) -> None:
    """``path.write_bytes(data)``, atomically."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | Path, text: str) -> None:
    """``path.write_text(text)`` in UTF-8, atomically."""
    write_bytes(path, text.encode("utf-8"))


@contextmanager
def staged_folder(folder: str | Path, *, replace: bool = True) -> Iterator[Path]:
    """Yield an empty staging folder; on success it becomes ``folder``.

    With ``replace`` an existing ``folder`` is moved aside and removed once the new one is in
    place; without it ``folder`` must be absent or empty.
    """
    staging = new_staging(folder)
    try:
        yield staging
        swap_into_place(staging, folder, replace=replace)
    except BaseException:
        discard(staging)
        raise


def new_staging(folder: str | Path) -> Path:
    """An empty staging sibling of ``folder`` for :func:`swap_into_place`, for writers whose
    work spans more than one block (a sweep cell: calibrated, then scored). It gets the
    permissions of a plain ``mkdir`` (``mkdtemp`` would make it 0700)."""
    folder = Path(os.path.abspath(folder))  # abspath: "." and "x/" have names
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    os.chmod(staging, 0o777 & ~_umask())
    return staging


def discard(staging: str | Path) -> None:
    """Remove a staging folder that will not be swapped in."""
    shutil.rmtree(staging, ignore_errors=True)


def swap_into_place(staging: str | Path, folder: str | Path, *, replace: bool = True) -> None:
    """Make the filled ``staging`` folder ``folder`` by one rename (see :func:`staged_folder`)."""
    staging, folder = Path(staging), Path(os.path.abspath(folder))
    if folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()  # os.replace needs it gone on every platform
    if not folder.exists():
        os.replace(staging, folder)
        return
    if not replace:
        raise FileExistsError(f"{folder} appeared while it was being written")
    retired = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    os.replace(folder, retired)
    os.replace(staging, folder)
    shutil.rmtree(retired, ignore_errors=True)
