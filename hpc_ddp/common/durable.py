"""Small durable-write helpers shared by checkpoints and staging: data that a marker or pointer vouches
for must be on disk before the marker or pointer is. And one careful reader, `read_regular`, for files
in a directory someone else may have tampered with: it never follows a symlink in the last component,
never blocks on a FIFO or device, never opens anything but a regular file, and reads at most `limit`
bytes. And the two writers everything hpc-ddp keeps in a run dir goes through, `write_file` (whole files) and
`appending` (records and logs): neither ever writes through a symlink someone planted at the path, nor opens a
FIFO or device there. It imports nothing heavy, so light modules (attempts.py) can use it too."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "write_durable", "stream_durable", "replace_durable", "read_regular", "NotRegularFile",
           "TooLarge", "file_kind", "write_file", "appending", "append", "read_bounded"]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it. One OSError on failure (ENOSPC included): the file is closed
    without a second, buffered flush that would fail again and chain a second traceback."""
    stream_durable(path, lambda write: write(data))


def stream_durable(path: Path, produce: Callable[[Callable[[Any], int]], object]) -> None:
    """`write_durable` for data made while it is written: `produce(write)` calls `write(chunk)` (any
    buffer; returns its length) for each chunk, and the file is fsynced once `produce` returns. Unbuffered
    `os.write`, which releases the GIL: a writer thread leaves the other threads' Python running."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)

    def write(chunk: Any) -> int:
        return _write_all(fd, chunk)

    try:
        produce(write)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: Any) -> int:
    """Write all of `data` (any buffer) to `fd`, however many os.write calls it takes; its length."""
    view = memoryview(data).cast("B")
    size = len(view)
    while view:
        view = view[os.write(fd, view):]
    return size


def replace_durable(path: Path, data: bytes) -> None:
    """Atomically replace `path` with `data`: temp file beside it, fsync, rename, fsync the directory.
    Never "remove old, then write new": a reader sees the old content or the new, nothing between.
    On failure the temp file is removed and `path` is as it was."""
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # never created, or already gone: the original error is the one to raise
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


class NotRegularFile(OSError):
    """The path is a symlink, FIFO, directory, socket or device: refused without opening it."""


class TooLarge(OSError):
    """The file is larger than the caller's limit: refused without reading it."""


def file_kind(mode: int) -> str:
    """'a FIFO', 'a symbolic link', ... for an st_mode."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "an unknown kind of file"


def _check(path: str | os.PathLike, st: os.stat_result, limit: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = file_kind(st.st_mode)
        how = "not followed" if stat.S_ISLNK(st.st_mode) else "not opened"
        raise NotRegularFile(errno.EINVAL, f"is {kind}, not a regular file ({how})", os.fspath(path))
    if limit is not None and st.st_size > limit:
        raise TooLarge(errno.EFBIG, f"is {st.st_size:,} bytes, more than the {limit:,} it can be (not read)",
                       os.fspath(path))


def _read_upto(fd: int, n: int | None) -> bytes:
    """Up to `n` bytes (None: all) from `fd`, to its end."""
    parts: list[bytes] = []
    got = 0
    while n is None or got < n:
        chunk = os.read(fd, 1 << 20 if n is None else min(n - got, 1 << 20))
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def read_regular(path: str | os.PathLike, *, limit: int | None = None, dir_fd: int | None = None,
                 listed: bool = False) -> bytes:
    """The bytes of the regular file at `path` (relative to `dir_fd` if given).

    Raises NotRegularFile for anything else (a symlink in the last component included: it is never
    followed), TooLarge when the file has more than `limit` bytes, and OSError when it cannot be read.
    The type is checked before opening (so no FIFO or device is ever opened) and again on the open file
    descriptor (so a swap in between is caught); O_NONBLOCK keeps even that race from blocking.
    `listed`: the caller lstat'ed the path a moment ago and saw a regular file (a snapshot's listing), so
    the check before opening is skipped; the one on the descriptor still refuses anything swapped in."""
    if not listed:
        _check(path, os.stat(path, dir_fd=dir_fd, follow_symlinks=False), limit)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # swapped for a symlink since the stat above
            raise NotRegularFile(errno.ELOOP, "is a symbolic link, not a regular file (not followed)",
                                 os.fspath(path)) from None
        raise
    try:
        st = os.fstat(fd)
        _check(path, st, limit)
        # what the file holds, +1 byte to see it grew (its size is within `limit`: _check): one read
        want = st.st_size + 1
        data = os.read(fd, want)
        if len(data) < st.st_size:  # a short read (a signal, a network filesystem): read on
            data += _read_upto(fd, want - len(data))
        if len(data) == want and (limit is None or want <= limit):  # it grew since the fstat: read on
            data += _read_upto(fd, None if limit is None else limit + 1 - want)
    finally:
        os.close(fd)
    if limit is not None and len(data) > limit:  # grew while we read it
        raise TooLarge(errno.EFBIG, f"is more than the {limit:,} bytes it can be (not read)", os.fspath(path))
    return data


def write_file(path: str | os.PathLike, data: bytes | str, mode: int = 0o644, *, durable: bool = False) -> None:
    """Replace `path` with `data`, whole or not at all, with `mode` from the moment the file exists.

    The data goes to a new file of a random name beside `path` (created exclusively, never through a link),
    then is renamed over `path`: a symlink planted at `path` is replaced, its target never written; a
    directory there is refused by the rename. `durable`: fsync the file and the folder too."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask took bits away: `mode` is what was asked for
            _write_all(fd, raw)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


@contextlib.contextmanager
def appending(path: str | os.PathLike, mode: int = 0o644) -> Iterator[int]:
    """A file descriptor that appends to the regular file at `path` (created with `mode` if missing).

    Raises NotRegularFile for a symlink at `path` (never followed: its target is not written), a FIFO (never
    waited on), a device or a directory."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # a link; a FIFO nobody reads; a folder
            st = os.stat(path, follow_symlinks=False)
            raise NotRegularFile(exc.errno, f"is {file_kind(st.st_mode)}, not a regular file (not written)",
                                 os.fspath(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(errno.EINVAL, f"is {file_kind(st.st_mode)}, not a regular file (not written)",
                                 os.fspath(path))
        os.set_blocking(fd, True)
        yield fd
    finally:
        os.close(fd)


def append(path: str | os.PathLike, data: bytes | str, *, durable: bool = False, mode: int = 0o644) -> None:
    """Append `data` to the regular file at `path` (see `appending`), in one write; fsync it if `durable`."""
    raw = data.encode() if isinstance(data, str) else data
    with appending(path, mode) as fd:
        _write_all(fd, raw)
        if durable:
            os.fsync(fd)


def read_bounded(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a file the user points at (a job file, the profiles file): links are followed (a
    dotfile manager makes them), but only a regular file is read, never a FIFO or device (no hang, no
    endless read), and only up to `limit` bytes (TooLarge beyond)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _check(path, os.fstat(fd), limit)
        data = _read_upto(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise TooLarge(errno.EFBIG, f"is more than the {limit:,} bytes it can be (not read)", os.fspath(path))
    return data


def read_tail(path: str | os.PathLike, limit: int, *, head: bool = False) -> bytes:
    """The last `limit` bytes (`head`: the first) of the regular file at `path` (a rank's log, however big: never read whole,
    so a log of many GB is no MemoryError); b"" for anything else (a FIFO is never waited on, a device never
    read) or a file that cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return b""
        if st.st_size > limit and not head:
            os.lseek(fd, st.st_size - limit, os.SEEK_SET)
        return _read_upto(fd, limit)
    except OSError:
        return b""
    finally:
        os.close(fd)
