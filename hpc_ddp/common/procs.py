"""The edge to external commands (sbatch, squeue, scontrol, ...): a tiny interface with a real and a fake;
and the edge to our own processes: pid files checked before any signal, children that die with us.

Executors and status commands take a `CommandRunner`; tests pass a `FakeCommands` with scripted answers
instead of patching subprocess (in the spirit of httpx's MockTransport).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn, Protocol

from hpc_ddp.common import verbosity
from hpc_ddp.common.errors import SubmitError

__all__ = ["Completed", "CommandRunner", "SubprocessCommands", "FakeCommands", "slurm_unreachable", "ProcessIdentity",
           "write_pid_file", "read_pid_file", "signal_process", "die_with_parent_preexec", "exit_after_handlers"]

# What Slurm's commands print when the controller is down: not the user's mistake, try again later.
_UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out", "Connection refused")


def slurm_unreachable(message: str) -> bool:
    return any(sign in message for sign in _UNREACHABLE)


@dataclasses.dataclass(frozen=True)
class Completed:
    argv: tuple[str, ...]
    returncode: int
    stdout: str = ""
    stderr: str = ""


class CommandRunner(Protocol):
    def run(self, argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
            timeout: float = 60) -> Completed: ...

    def which(self, name: str) -> str | None: ...


class SubprocessCommands:
    def run(self, argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
            timeout: float = 60) -> Completed:
        verbosity.detail(f"running {shlex.join(argv)}" + (f" (in {cwd})" if cwd else ""))  # -v
        try:
            proc = subprocess.run(list(argv), cwd=cwd, env=None if env is None else dict(env),
                                  capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            raise SubmitError(f"{argv[0]} not found", hint="is Slurm installed here (try `which sbatch`)?") from None
        except subprocess.TimeoutExpired:
            raise SubmitError(f"{argv[0]} did not answer within {timeout:.0f} s") from None
        return Completed(tuple(argv), proc.returncode, proc.stdout, proc.stderr)

    def which(self, name: str) -> str | None:
        return shutil.which(name)


class FakeCommands:
    """Records every call; answers from `handlers` (command name -> function of argv) or a default."""

    def __init__(self, handlers: Mapping[str, Callable[[Sequence[str]], Completed]] | None = None,
                 installed: Sequence[str] = ("sbatch", "squeue", "scontrol", "scancel", "sinfo")):
        self.handlers = dict(handlers or {})
        self.installed = set(installed)
        self.calls: list[tuple[tuple[str, ...], str | None]] = []

    def run(self, argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
            timeout: float = 60) -> Completed:
        self.calls.append((tuple(argv), cwd))
        handler = self.handlers.get(argv[0])
        if handler is None:
            return Completed(tuple(argv), 127, "", f"{argv[0]}: command not found")
        return handler(argv)

    def which(self, name: str) -> str | None:
        return f"/usr/bin/{name}" if name in self.installed else None


# ---- our own processes: pid files that never name a stranger, children that die with us ----

def _proc_read(pid: int, name: str) -> bytes | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            return fh.read()
    except (OSError, ValueError):
        return None


def _start_ticks(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat: when the process started, in clock ticks since boot. A recycled pid
    has another start time. The name (field 2) may hold spaces and ')': split after its last ')'."""
    stat = _proc_read(pid, "stat")
    if stat is None:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    return fields[19].decode() if len(fields) > 19 else None


def _boot_id() -> str:
    """Start times count from boot: after a reboot the same pid and start time can come back."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or "-"
    except OSError:
        return "-"


def _cmdline_digest(pid: int) -> str | None:
    import hashlib

    cmdline = _proc_read(pid, "cmdline")
    return hashlib.sha256(cmdline).hexdigest()[:16] if cmdline else None


@dataclasses.dataclass(frozen=True)
class ProcessIdentity:
    """What tells one process apart from any later one that gets the same pid: its start time (this
    boot) and its command line."""

    pid: int
    start: str
    boot: str
    cmdline: str

    @classmethod
    def of(cls, pid: int) -> "ProcessIdentity | None":
        start, cmdline = _start_ticks(pid), _cmdline_digest(pid)
        if start is None or cmdline is None:
            return None
        return cls(pid, start, _boot_id(), cmdline)

    def alive(self) -> bool:
        """This very process still runs (not a zombie of it, not another one with its pid)."""
        stat = _proc_read(self.pid, "stat")
        if stat is None or stat[stat.rfind(b")") + 2:][:1] in (b"Z", b"X"):
            return False
        return ProcessIdentity.of(self.pid) == self


def write_pid_file(path, tag: str) -> None:
    """`PID TAG START BOOT CMDLINE-DIGEST` for this process (TAG: a job id, no spaces)."""
    me = ProcessIdentity.of(os.getpid())
    fields = [str(os.getpid()), tag, *((me.start, me.boot, me.cmdline) if me else ("-", "-", "-"))]
    Path(path).write_text(" ".join(fields) + "\n")


def read_pid_file(path) -> tuple[ProcessIdentity | None, str | None, str]:
    """(the recorded process if it still runs, its tag, why not). A pid file of an older hpc-ddp
    (no start time) or one whose process is gone or was replaced by another is never trusted."""
    try:
        fields = Path(path).read_text().split()
    except (OSError, ValueError):
        return None, None, "no pid file"
    tag = fields[1] if len(fields) > 1 else None
    if len(fields) < 5 or not fields[0].isdigit() or "-" in (fields[2], fields[4]):
        return None, tag, "its pid file does not say which process it was (stale or from an older hpc-ddp)"
    recorded = ProcessIdentity(int(fields[0]), fields[2], fields[3], fields[4])
    if not recorded.alive():
        return None, tag, f"process {recorded.pid} is gone (its pid may now belong to another program)"
    return recorded, tag, "running"


def signal_process(who: ProcessIdentity, signum: int) -> bool:
    """Send `signum` to `who` only: through a pidfd opened before the identity is checked, so the pid
    cannot be recycled between the check and the signal. False if it is no longer that process."""
    try:
        fd = os.pidfd_open(who.pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # no pidfd (old kernel): check, then signal by pid
        if not who.alive():
            return False
        try:
            os.kill(who.pid, signum)
        except ProcessLookupError:
            return False
        return True
    try:
        if not who.alive():
            return False
        signal.pidfd_send_signal(fd, signum)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def die_with_parent_preexec() -> Callable[[], None] | None:
    """A preexec_fn that makes the child die (SIGKILL) when this process does (PR_SET_PDEATHSIG; kept
    across exec of a normal program), or None where prctl is missing. Built in the parent: the child
    only makes one foreign call. PDEATHSIG fires when the parent *thread* that forked ends: call from a
    thread that lives as long as the children (the main thread)."""
    libc = _libc()
    if libc is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)
    return preexec


def exit_after_handlers(code: int) -> NoReturn:
    """Leave with `code` after the Python exit handlers (a session's close, a logger's finish) and with
    stdout/stderr flushed, but before C++ static destructors run. Those are what sometimes abort a rank that
    has already finished, with "terminate called without an active exception" (a torch.distributed
    thread still joinable at exit); `os._exit` is also the only way to set the code from an excepthook."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_PR_SET_PDEATHSIG = 1
_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _LIBC.append(libc if hasattr(libc, "prctl") else None)
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]
