"""Reading and copying the project's files for its snapshot (snapshot.py plans and takes it): every file
read once, by folder descriptors opened one name at a time without following a link (nothing outside the
project is ever read, nothing outside the copy written), within the byte budget the snapshot limit leaves
(a file that grows while it is read cannot take the copy past it), and, for a big project, by two
processes that each copy half.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from hpc_ddp.common.durable import NotRegularFile, TooLarge, read_regular
from hpc_ddp.common.errors import HpcDdpError, UserError
from hpc_ddp.snapshot.listing import Item, Listing, _shown, parents


class _Folders:
    """Descriptors of a tree's folders, opened one name at a time without following a link, so that a path
    under them reaches nothing outside the tree even where a folder is swapped for a link meanwhile."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._fds: dict[str, int] = {}

    def fd(self, rel: str) -> int:
        if rel in self._fds:
            return self._fds[rel]
        if len(self._fds) > 256:
            self.close()
        parent, _, name = rel.rpartition("/")
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        if rel:
            fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=self.fd(parent))
        else:
            fd = os.open(self.root, flags)
        self._fds[rel] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _Tree(_Folders):
    """The project's files, read through folder descriptors (`_Folders`): nothing outside the project."""

    def read(self, rel: str, limit: int | None = None) -> bytes:
        folder, _, name = rel.rpartition("/")
        try:
            return read_regular(name, dir_fd=self.fd(folder), limit=limit, listed=True)
        except TooLarge:
            raise UserError(f"{_shown(rel)} in the project {_shown(self.root)} grew past the snapshot limit while it "
                            "was read", hint="leave it out (--snapshot-exclude NAME), or raise --snapshot-max-mb") \
                from None
        except NotRegularFile:
            raise UserError(f"{_shown(rel)} in the project {self.root} changed while it was copied (it is no longer "
                            "a regular file)", hint="submit again") from None
        except OSError as exc:
            raise UserError(f"cannot read {_shown(rel)} in the project {self.root}: {exc.strerror or exc}",
                            hint="fix its permissions, or leave it out of the snapshot (--snapshot-exclude NAME)") \
                from None


class _Budget:
    """The bytes a snapshot may still read: a file that grew since it was listed (a log being written)
    cannot take the copy past the limit."""

    def __init__(self, limit: int | None) -> None:
        self.left = limit

    def spend(self, rel: str, n: int) -> None:
        if self.left is not None:
            self.left -= n
            if self.left < 0:
                raise UserError(f"{_shown(rel)} grew past the snapshot limit while it was read",
                                hint="leave it out (--snapshot-exclude NAME), or raise --snapshot-max-mb")


def _each_file(project: str, files: Iterable[Item], budget: _Budget) -> Iterator[tuple[Item, bytes]]:
    """Each file's bytes, read once, within the budget: never copied past it."""
    tree = _Tree(project)
    try:
        for item in files:
            data = tree.read(item.rel, budget.left)
            budget.spend(item.rel, len(data))
            yield item, data
    finally:
        tree.close()


def _copy(listing: Listing, dest: Path, limit: int | None = None) -> dict[str, str]:
    made = {""}
    folders = _Folders(str(dest))  # made one name at a time by descriptor: a path past PATH_MAX is no error
    try:
        for item in listing.items:
            parent = item.rel.rpartition("/")[0]
            if parent not in made:
                for folder in parents(parent):
                    if folder not in made:
                        up, _, name = folder.rpartition("/")
                        with contextlib.suppress(FileExistsError):
                            os.mkdir(name, dir_fd=folders.fd(up))
                        made.add(folder)
            if item.kind != "file":
                os.symlink(item.target, item.rel.rpartition("/")[2], dir_fd=folders.fd(parent))
    finally:
        folders.close()
    files = listing.files
    if not _can_fork() or len(files) < FORK_FROM_FILES:
        return _copy_files(listing.project, files, dest, _Budget(limit))
    # two processes, each copying half the files (the cost of a file: a few creates, then its bytes): the
    # copy is Python per file, which one interpreter's threads cannot share out (bench/README.md)
    cut = _halfway(files)
    mine, theirs = files[:cut], files[cut:]
    slack = None if limit is None else limit - sum(i.size for i in files)  # what files may grow by, in all
    budgets = (_Budget(None if slack is None else sum(i.size for i in mine) + slack // 2),
               _Budget(None if slack is None else sum(i.size for i in theirs) + slack - slack // 2))
    child = _Child.start(lambda: _copy_files(listing.project, theirs, dest, budgets[1]))
    try:
        hashes = _copy_files(listing.project, mine, dest, budgets[0])
    except BaseException:
        child.stop()
        raise
    hashes.update(child.result())
    return hashes


FORK_FROM_FILES = 1_000  # fewer files: one process (a fork costs a few milliseconds)


def _can_fork() -> bool:
    """Linux only (macOS's frameworks are not fork-safe), and only where this process has no other thread
    (one could hold a lock the child would wait on forever)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and threading.active_count() == 1


def _halfway(files: list[Item]) -> int:
    """Where to cut `files` so both halves cost the same: a file costs its creates (~20 KB of copying)
    plus its bytes."""
    costs = [20_000 + i.size for i in files]
    half, run = sum(costs) / 2, 0
    for n, cost in enumerate(costs):
        run += cost
        if run >= half:
            return n + 1
    return len(files)


def _copy_files(project: str, files: list[Item], dest: Path, budget: _Budget) -> dict[str, str]:
    """Copy `files` of the project into `dest` (its folders made already); their sha256."""
    hashes: dict[str, str] = {}
    folders = _Folders(str(dest))  # our own new folders: created in by descriptor, not by path
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        for item, data in _each_file(project, files, budget):
            hashes[item.rel] = hashlib.sha256(data).hexdigest()
            parent, _, name = item.rel.rpartition("/")
            # read-only from the start: a traceback's file opened in an editor is the copy, and an edit there
            # would be lost
            fd = os.open(name, flags, 0o555 if item.executable else 0o444, dir_fd=folders.fd(parent))
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
    finally:
        folders.close()
    return hashes


class _Child:
    """A forked process that runs one function returning a dict of strings, and hands it (or the error it
    raised) back through a pipe. It writes nothing to the terminal and never returns into our code."""

    def __init__(self, pid: int, fd: int) -> None:
        self.pid, self.fd = pid, fd

    @classmethod
    def start(cls, fn: Callable[[], dict[str, str]]) -> _Child:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            code = 1
            try:
                os.close(read_end)
                try:
                    answer: dict[str, Any] = {"result": fn()}
                except UserError as exc:
                    answer = {"user_error": exc.message, "hint": exc.hint}
                except BaseException as exc:  # noqa: BLE001 - handed to the parent, which raises it
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                view = memoryview(json.dumps(answer, ensure_ascii=False).encode("utf-8", "surrogateescape"))
                while view:
                    view = view[os.write(write_end, view):]
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        return cls(pid, read_end)

    def result(self) -> dict[str, str]:
        chunks = []
        try:
            while chunk := os.read(self.fd, 1 << 20):
                chunks.append(chunk)
        finally:
            os.close(self.fd)
            os.waitpid(self.pid, 0)
        try:
            answer = json.loads(b"".join(chunks).decode("utf-8", "surrogateescape"))
        except ValueError:
            raise HpcDdpError("the snapshot's second copying process ended without an answer") from None
        if "user_error" in answer:
            raise UserError(answer["user_error"], hint=answer["hint"])
        if "error" in answer:
            raise HpcDdpError(f"the snapshot's second copying process failed: {answer['error']}")
        return answer["result"]

    def stop(self) -> None:
        """Kill it and wait for it: the half-made copy is removed next, and nothing may write into it then."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        os.close(self.fd)
        os.waitpid(self.pid, 0)


def _remove_copy(path: Path) -> None:
    """Remove a half-made copy of ours (read-only files in writable folders: rmtree can)."""
    shutil.rmtree(path, ignore_errors=True)
