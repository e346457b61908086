"""A dataset's source as this machine can tell before anything queues: whether a path surely does not exist
here (`missing_here`: only where its filesystem is visible), and whether it is something staging can take, a
directory or an archive (`source_problem`). The spec refuses what is surely wrong (jobspec.py); staging
(data.staging) applies the same rules when it stages, and re-exports these names."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hpc_ddp.common.errors import UserError

__all__ = ["ARCHIVE_SUFFIXES", "StageRefused", "source_kind", "source_problem", "missing_here"]

ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")


class StageRefused(UserError):
    """What was asked cannot be staged safely (a bad name, overlapping paths, a source that is not a dataset)."""


def source_kind(src: Path) -> str:
    """'dir' or 'archive'. A single plain file is refused rather than guessed at: the staged path is always
    a directory (DATASETS_PATH/NAME), and a file's copy there would not be where a program looks for it."""
    try:
        info = src.stat()
    except FileNotFoundError:
        raise StageRefused(f"dataset source {str(src)!r} does not exist") from None
    except OSError as exc:
        raise StageRefused(f"cannot read dataset source {str(src)!r}: {exc.strerror}") from None
    if stat.S_ISDIR(info.st_mode):
        return "dir"
    if stat.S_ISREG(info.st_mode) and src.name.endswith(ARCHIVE_SUFFIXES):
        return "archive"
    what = "a single file" if stat.S_ISREG(info.st_mode) else "not a regular file or directory"
    raise StageRefused(f"dataset source {str(src)!r} is {what}: staging takes a directory or an archive "
                       f"({', '.join(ARCHIVE_SUFFIXES)})",
                       hint="put the file in a directory and stage that directory, or pack it as a .tar")


def source_problem(path: str) -> tuple[str, str] | None:
    """(message, hint) when this machine can tell for sure that `path` cannot be staged, else None."""
    p = Path(os.path.abspath(path))
    if not os.path.exists(p):
        missing = missing_here(str(p))
        return (f"dataset source {missing}", "give a directory or an archive (.tar, .tar.gz, .zip) that exists") \
            if missing else None
    try:
        source_kind(p)
    except StageRefused as exc:
        return exc.message, exc.hint or ""
    return None


def missing_here(path: str) -> str | None:
    """Why `path` surely does not exist (e.g. "/data/mnsit does not exist (/data has no 'mnsit')"), or None
    when it exists or this machine cannot tell.

    A missing path counts only where its filesystem is visible here: its nearest existing ancestor is a
    non-empty directory below `/`. A missing top-level directory, or an empty one (an unmounted mount point,
    an autofs root), may be a filesystem only the compute nodes mount: that is the preflight's to report."""
    p = Path(os.path.abspath(path))
    if os.path.exists(p):
        return None
    ancestor = p.parent
    while not os.path.exists(ancestor):
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{p} cannot exist: {ancestor} is a file"
    if ancestor == ancestor.parent:
        return None
    try:
        with os.scandir(ancestor) as entries:
            if next(entries, None) is None:
                return None
    except OSError:
        return None  # unreadable here: cannot tell
    return f"{p} does not exist ({ancestor} has no {p.relative_to(ancestor).parts[0]!r})"
