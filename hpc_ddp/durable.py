"""Small durable-write helpers shared by checkpoints and staging: data that a marker or pointer vouches
for must be on disk before the marker or pointer is."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

__all__ = ["fsync_dir", "write_durable", "replace_durable"]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def replace_durable(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data`: temp file beside it, fsync, rename, fsync the directory.
    Never "remove old, then write new": a reader sees the old content or the new, nothing between."""
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    write_durable(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
