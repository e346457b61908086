"""One rank 0 per run dir on a host: the lock a Session's rank 0 holds while it writes the run dir.

Two processes that both believe they are rank 0 of one run would both write its checkpoints, records and
finish: `step-4`, `step-4-r1` and two finish records, and a resume that reads one writer's half. It happens
when a script's own mp.spawn children each call `hpc_ddp.start()` under one task (each inherits the task's
RANK=0, WORLD_SIZE=1), or when one run dir is given to two runs at once on a node. Both writers share a
host, so the lock is a host-local file (the temporary folder), keyed by the run dir's real path and the
user: no lock on a network filesystem (which Lustre may not offer, and which a dead node would hold past
its failure), and a rank 0 that moved to another node after a failure is never refused.

`flock` is released by the kernel when the process ends, however it ends (a child it forked, a DataLoader
worker, shares the lock: a holder whose recorded pid is gone is no writer). A lock file that is not the
user's own, or a folder where no lock can be taken, means no lock: never a refusal of a run that may be
fine. hpc-ddp removes only the lock file it made and held.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import stat
import tempfile

__all__ = ["WriterLock", "lock_path"]


def lock_path(run_dir: str, folder: str | None = None) -> str:
    key = hashlib.sha256(os.path.realpath(run_dir).encode(errors="surrogateescape")).hexdigest()[:20]
    return os.path.join(folder or tempfile.gettempdir(), f"hpc-ddp-rank0-{os.getuid()}-{key}.lock")


class WriterLock:
    """`acquire()`: None once held (or where no lock can be taken), else the pid of the process that holds
    it (as it wrote it; 0 where it cannot be read)."""

    def __init__(self, run_dir: str, folder: str | None = None) -> None:
        self.path = lock_path(run_dir, folder)
        self.fd: int | None = None

    def acquire(self) -> int | None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return None  # a link planted there, a full or read-only temporary folder: no lock
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                os.close(fd)
                return None  # not ours: never trusted, never a refusal
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd) if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
            os.close(fd)
            # this process holds it already (a notebook's second start(), a test's second Session): one writer;
            # the writer that took it is gone, and a child it forked (a DataLoader worker) still holds the
            # open file: no writer either
            return None if holder == os.getpid() or (holder and not _alive(holder)) else holder
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return None

    def release(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(self.path, follow_symlinks=False)):
                os.unlink(self.path)  # the file this process made and holds, nothing else
        except OSError:
            pass
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process by that number: alive
    return True


def _holder(fd: int) -> int:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0
