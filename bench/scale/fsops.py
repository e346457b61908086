"""Counting shared-filesystem metadata operations in this process, by path.

On Lustre or GPFS every stat, open, create, mkdir, rename, unlink and directory read of the run dir is a
request to the metadata server, shared by every job on the cluster. The simulation cannot run Lustre, so
it counts: `counting(shared_roots)` wraps the os-level calls that pathlib, glob, open() and shutil go
through, and counts each call whose path lies under one of `shared_roots` (the run dir and the dataset
source: what lives on the shared filesystem). Node-local paths (the simulated nodes' scratch dirs) are
counted apart, as `local`. A directory read is one operation per call (`listdir`/`scandir`); the entries
it returned are counted too (`entries`), since a large directory takes several requests to read.

Reads and writes of file contents are data, not metadata, and are not counted.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import threading
from collections import Counter
from collections.abc import Iterator, Sequence

__all__ = ["Ops", "counting"]

# The os functions that reach the metadata server, and the argument that holds the path.
_WRAPPED = ("stat", "lstat", "open", "mkdir", "rename", "replace", "unlink", "rmdir", "listdir", "scandir",
            "utime", "chmod")


class Ops:
    """Counters, by (where, operation): where is "shared" or "local"."""

    def __init__(self, shared_roots: Sequence[str], local_roots: Sequence[str] = ()):
        self.shared = tuple(os.path.abspath(r).rstrip("/") + "/" for r in shared_roots)
        self.local = tuple(os.path.abspath(r).rstrip("/") + "/" for r in local_roots)
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def where(self, path) -> str | None:
        if isinstance(path, int):  # an fd: os.stat(fd) is fstat, no lookup on the server
            return None
        try:
            text = os.fsdecode(os.fspath(path))
        except TypeError:
            return None
        full = text if text.startswith("/") else os.path.join(os.getcwd(), text)
        full = full.rstrip("/") + "/"
        if full.startswith(self.shared):
            return "shared"
        if full.startswith(self.local):
            return "local"
        return None

    def add(self, where: str, op: str, n: int = 1) -> None:
        with self._lock:
            self.counts[(where, op)] += n

    def total(self, where: str = "shared") -> int:
        return sum(n for (w, op), n in self.snapshot().items() if w == where and op != "entries")

    def snapshot(self) -> Counter:
        with self._lock:
            return Counter(self.counts)

    def by_op(self, where: str = "shared") -> dict[str, int]:
        return {op: n for (w, op), n in sorted(self.snapshot().items()) if w == where}


def _wrap(ops: Ops, name: str, real):
    def counted(path, *args, **kwargs):
        where = ops.where(path)
        if where is not None:
            ops.add(where, name)  # before the call: a stat of a missing file is a request too
        result = real(path, *args, **kwargs)
        if where is not None and name == "listdir":
            ops.add(where, "entries", len(result))
        return result
    return counted


def _wrap_scandir(ops: Ops, real):
    class Counted:
        """os.scandir's iterator, counting the entries it yields."""

        def __init__(self, it, where):
            self.it, self.where = it, where

        def __iter__(self):
            return self

        def __next__(self):
            entry = next(self.it)
            if self.where:
                ops.add(self.where, "entries")
            return entry

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.it.close()

        def close(self):
            self.it.close()

    def scandir(path="."):
        where = ops.where(path)
        if where:
            ops.add(where, "scandir")
        return Counted(real(path), where)
    return scandir


def _wrap_open(ops: Ops, real):
    def counted_open(file, *args, **kwargs):
        where = ops.where(file)
        if where is not None:
            ops.add(where, "open")
        return real(file, *args, **kwargs)
    return counted_open


@contextlib.contextmanager
def counting(ops: Ops) -> Iterator[Ops]:
    """Count while inside; every thread of the process is counted (the simulated ranks are threads)."""
    saved = {name: getattr(os, name) for name in _WRAPPED}
    saved_open = builtins.open
    try:
        for name in _WRAPPED:
            setattr(os, name, _wrap_scandir(ops, saved[name]) if name == "scandir" else _wrap(ops, name, saved[name]))
        builtins.open = io.open = _wrap_open(ops, saved_open)
        yield ops
    finally:
        for name, real in saved.items():
            setattr(os, name, real)
        builtins.open = io.open = saved_open
