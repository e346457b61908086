"""Staging's durability and locking: the completion marker (ours only: it names the device and inode of
the directory it vouches for), one syncfs for the staged tree, the per-node stager lock (flock on local
disk), and the cp/tar child that dies with its stager. Used by staging.py and archives.py."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import stat
import time
from collections.abc import Callable
from pathlib import Path

from hpc_ddp.common.durable import read_regular, replace_durable
from hpc_ddp.data.stageerrors import ScratchUnusable, StagingError


def _complete(target: Path, marker: Path, key: str) -> bool:
    data = _read_marker(marker)
    # A "publishing" marker (written before the rename) claims the target but does not complete it.
    return (data is not None and data.get("key") == key and data.get("state") != "publishing"
            and data.get("dir") == _identity(target))


def _identity(path: Path) -> list[int] | None:
    """[device, inode] of the real directory at `path` (None: nothing, a link or a file there). A rename
    keeps them: the temp copy's identity, written into its marker, is the published target's."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return [st.st_dev, st.st_ino] if stat.S_ISDIR(st.st_mode) else None


def _read_marker(marker: Path) -> dict | None:
    """A marker hpc-ddp wrote (a regular file, never a link or FIFO, holding our JSON: a key and the
    identity of the directory it vouches for), else None."""
    try:
        data = json.loads(read_regular(marker, limit=1 << 20))
    except (OSError, ValueError):
        return None
    ours = (isinstance(data, dict) and data.get("made_by") == "hpc-ddp" and isinstance(data.get("key"), str)
            and isinstance(data.get("dir"), list))
    return data if ours else None


def _write_marker(marker: Path, data: dict, made: Path) -> None:
    """Write the marker for the directory `made` (the temp copy before its rename, or the target)."""
    replace_durable(marker, json.dumps({**data, "made_by": "hpc-ddp", "dir": _identity(made)}).encode())


def _fsync_tree(root: Path) -> None:
    """Make the staged files durable before the marker says they are complete. One syncfs(2) of the
    scratch filesystem instead of an fsync per file: with thousands of small files the per-file
    fsyncs cost more than the copy itself."""
    fd = os.open(root, os.O_RDONLY)
    try:
        if _LIBC is None or _LIBC.syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def _die_with_parent() -> None:
    """In the cp/tar child: die with the stager. A SIGKILLed stager must not leave a copy running into
    the temp dir that the next stager is about to clean up (PR_SET_PDEATHSIG)."""
    if _LIBC is not None:
        _LIBC.prctl(1, signal.SIGKILL)


def _load_libc():
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc if hasattr(libc, "syncfs") and hasattr(libc, "prctl") else None
    except OSError:
        return None


_LIBC = _load_libc()


class _exclusive:
    """flock on a local-disk lock file, polling so a stuck stager is reported instead of waited on forever."""

    def __init__(self, path: Path, timeout: float, log: Callable[[str], None]):
        self.path, self.timeout, self.log = path, timeout, log
        self.fd = -1

    def __enter__(self):
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise ScratchUnusable(f"cannot stage into {self.path.parent}: {exc.strerror}",
                                  hint="pass a writable directory to --dest (or set the profile's scratch)") from None
        deadline, said = time.monotonic() + self.timeout, False
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise StagingError(f"timed out after {self.timeout:.0f} s waiting for another stager "
                                       f"holding {self.path}", hint="see local rank 0's log on this node")
                if not said:
                    self.log(f"hpc-ddp stage: waiting for the stager on this node ({self.path.name})")
                    said = True
                time.sleep(0.1)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
