"""The edge to external commands (sbatch, squeue, scontrol, ...): a tiny interface with a real and a fake;
and the edge to our own processes: pid files checked before any signal, children that die with us, and
process trees that end as a whole (`Supervised`, below).

Executors and status commands take a `CommandRunner`; tests pass a `FakeCommands` with scripted answers
instead of patching subprocess (in the spirit of httpx's MockTransport).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn, Protocol

# Only the standard library at import: this file also runs as a script, the supervisor of one process tree
# (`python -I -S procs.py supervise ...`, started by `Supervised`), and hpc_ddp's own modules are imported
# where they are used.

__all__ = ["Completed", "CommandRunner", "SubprocessCommands", "FakeCommands", "slurm_unreachable", "ProcessIdentity",
           "write_pid_file", "read_pid_file", "signal_process", "die_with_parent_preexec", "exit_after_handlers",
           "Supervised", "can_supervise", "supervise"]

# What Slurm's commands print when the controller is down: not the user's mistake, try again later.
# (slurmctld stopped, hung, restarting, or no configuration to find it by)
_UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out", "Connection refused",
                "Zero Bytes were transmitted or received", "Communication connection failure",
                "Slurm temporarily unable to accept job", "Could not establish a configuration source",
                "Unable to establish a connection", "Connection timed out", "slurm_persist_conn_open")


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
        from hpc_ddp.common import verbosity
        from hpc_ddp.common.errors import SubmitError

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
    from hpc_ddp.common.durable import write_file  # here: procs.py also runs as a standalone script

    write_file(path, " ".join(fields) + "\n")  # a link planted at the pid file is replaced, not written through


def read_pid_file(path) -> tuple[ProcessIdentity | None, str | None, str]:
    """(the recorded process if it still runs, its tag, why not). A pid file of an older hpc-ddp
    (no start time) or one whose process is gone or was replaced by another is never trusted."""
    from hpc_ddp.common.durable import NotRegularFile, TooLarge, read_regular  # here: see write_pid_file

    try:  # a regular file of at most 4 KB: a FIFO in its place is never waited on, /dev/zero never read
        fields = read_regular(path, limit=4096).decode(errors="replace").split()
    except (NotRegularFile, TooLarge) as exc:
        return None, None, f"its pid file {exc.strerror} (it is not one hpc-ddp wrote)"
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

            libc = ctypes.CDLL(None, use_errno=True)  # this program's own libc, without a search (ldconfig)
            if not hasattr(libc, "prctl"):
                import ctypes.util

                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            _LIBC.append(libc if hasattr(libc, "prctl") else None)
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


# ---- process trees that end as a whole ----
#
# A rank (or a node_setup script) may start processes of its own: DataLoader workers, `sleep 1000 &`, a
# daemon that moves to a session of its own. A signal to the rank's process group misses the last kind, and
# nothing reached any of them once the rank had ended, or when hpc-ddp was SIGKILLed (PDEATHSIG is not
# inherited by a fork). So each such command runs under a supervisor: this file run as a script, leader of
# the command's session and group, and its child subreaper (PR_SET_CHILD_SUBREAPER): a descendant whose
# parent dies becomes the supervisor's child, whatever session it moved to, so none can get away. The
# supervisor exits only when no descendant is left, with the command's own exit status.

_PR_SET_CHILD_SUBREAPER = 36
_KILL_NOW = b"K"  # on the control pipe: SIGKILL every descendant now
_TICK_S = 0.05
_NOT_IGNORED = {"SIGKILL", "SIGSTOP", "SIGCHLD", "SIGCONT", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT",
                "SIGTRAP", "SIGSYS"}


class Supervised(subprocess.Popen):
    """`argv` run under a supervisor, in a session and process group of its own.

    signal_group(): a signal to every process of the group (the supervisor ignores it); kill_group(): SIGKILL
    to every descendant, those that left the group too; stop(): SIGTERM, then kill_group() `grace` s later.
    When the command ends, the supervisor stops what it left running (SIGTERM, SIGKILL `grace` s later);
    when this process dies, however (SIGKILL included), it stops everything the same way. poll() and wait()
    give the command's exit status (negative: the signal that killed it). Linux only; elsewhere a plain
    session: its group is signalled, and nothing stops it when this process is SIGKILLed (as where this file
    is not a file on disk, in a zip, or Python cannot say where its interpreter is)."""

    def __init__(self, argv: Sequence[str], *, grace: float, **popen_kwargs):
        self._control: int | None = None
        self._supervised = can_supervise()
        if not self._supervised:
            super().__init__(list(argv), start_new_session=True, **popen_kwargs)
            return
        env = popen_kwargs.get("env")
        read, self._control = os.pipe()  # both ends not inheritable: the write end stays ours alone
        try:
            super().__init__(supervisor_argv(argv, read, grace, os.environ if env is None else env), pass_fds=(read,),
                             start_new_session=True, **popen_kwargs)
        except BaseException:
            self._close_control()
            raise
        finally:
            os.close(read)

    def signal_group(self, signum: int) -> None:
        """`signum` to the command's group, only while its leader (the supervisor, whose pid names the group)
        is not reaped: the group's id is then ours, never a stranger's."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signum)

    def kill_group(self) -> None:
        """SIGKILL to every descendant of the supervisor, which then exits. Never to the supervisor itself:
        what left the group would then be nobody's. Asked again, it does nothing more."""
        if not self._supervised:
            self.signal_group(signal.SIGKILL)
        elif self._control is not None:
            with contextlib.suppress(OSError):  # it has just exited
                os.write(self._control, _KILL_NOW)
            self._close_control()

    def stop(self, grace: float) -> int:
        """SIGTERM to the group; what still runs `grace` s later, killed. The command's exit status."""
        self.signal_group(signal.SIGTERM)
        try:
            return self.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill_group()
            return self.wait()

    def poll(self):
        code = super().poll()
        if code is not None:
            self._close_control()
        return code

    def wait(self, timeout=None):
        code = super().wait(timeout)
        self._close_control()
        return code

    def _close_control(self) -> None:
        if self._control is not None:
            os.close(self._control)
            self._control = None


def can_supervise() -> bool:
    """Linux (a subreaper, /proc), this file on disk and a known interpreter: the supervisor can run."""
    return sys.platform.startswith("linux") and bool(sys.executable) and os.path.isfile(__file__)


def supervisor_argv(argv: Sequence[str], control: int, grace: float, env: Mapping[str, str]) -> list[str]:
    """This file as a script, with this Python, isolated (-I -S: no user's PYTHONPATH or site can change
    it). Python sets LC_CTYPE where the locale is C (PEP 538): the command gets the value `env` has."""
    lc_ctype = env.get("LC_CTYPE")
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), "supervise", str(control), f"{grace:g}",
            "-" if lc_ctype is None else f"={lc_ctype}", "--", *argv]


def supervise(args: Sequence[str]) -> NoReturn:
    """The supervisor: `supervise CONTROL_FD GRACE LC_CTYPE -- ARGV...` (see Supervised). The command is
    its child; hpc-ddp's byte on CONTROL_FD means "kill everything now", its end (EOF) "stop everything"."""
    control, grace, lc_ctype, argv = int(args[0]), float(args[1]), args[2], list(args[4:])
    os.set_inheritable(control, False)
    libc = _libc()
    if libc is not None:
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)
    for signum in signal.valid_signals():  # a handler, not SIG_IGN: exec resets it for the command
        if getattr(signum, "name", "") not in _NOT_IGNORED:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(signum, _ignore)
    if lc_ctype == "-":
        os.environ.pop("LC_CTYPE", None)
    else:
        os.environ["LC_CTYPE"] = lc_ctype[1:]
    wake, woken = os.pipe()  # a child's end (SIGCHLD) wakes the wait: no polling while the command runs
    os.set_blocking(wake, False)
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, _ignore)
    _exit_as(_watch(_spawn(argv, libc), control, wake, grace))


def _ignore(_signum, _frame) -> None:
    """The group's signals are the command's: the supervisor lets them pass."""


def _spawn(argv: list[str], libc) -> int:
    """Fork and exec the command; it dies with its supervisor, should anyone SIGKILL that."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(137)
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(2, f"hpc-ddp: cannot run {argv[0]}: {exc.strerror}\n".encode(errors="replace"))
        os._exit(127 if isinstance(exc, FileNotFoundError) else 126)
    finally:
        os._exit(127)


def _watch(child: int, control: int, wake: int, grace: float) -> int:
    """Wait for the command, then for every descendant; the command's wait status. When the command has
    ended, or hpc-ddp is gone, every descendant gets SIGTERM, and SIGKILL `grace` s later (at once on
    hpc-ddp's word). A process that becomes its child meanwhile (its parent died) gets the SIGTERM too."""
    status, kill_at, listening, termed = None, None, True, set()
    while True:
        reaped, others = _reap(child)
        status = reaped if status is None else status
        if status is not None and not others:
            return status
        if kill_at is None and status is not None:  # the command ended: what it left is stopped
            kill_at = _terminate_group(grace)
        if kill_at is not None:  # each child outside the group, once (the command's group got it)
            _signal_children(signal.SIGTERM, skip=termed, outside_group=True)
            if time.monotonic() >= kill_at:
                _signal_children(signal.SIGKILL)  # never the group: the supervisor is in it
        order = _order(control if listening else None, wake, None if kill_at is None else _TICK_S)
        if order == b"":  # hpc-ddp closed its end: it ended, or it stops everything
            listening = False
            if kill_at is None:
                kill_at = _terminate_group(grace)
        if order and _KILL_NOW in order:
            kill_at = time.monotonic()


def _terminate_group(grace: float) -> float:
    """SIGTERM to the supervisor's group (the command and what it started in it); when to SIGKILL the rest."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(0, signal.SIGTERM)
    return time.monotonic() + grace


def _reap(child: int) -> tuple[int | None, bool]:
    """Reap every ended child: (the command's wait status if it was among them, whether any child is left)."""
    status = None
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status, False
        if pid == 0:
            return status, True
        if pid == child:
            status = code


def _order(control: int | None, wake: int, timeout: float | None) -> bytes | None:
    """Wait for a signal (a child's end) or hpc-ddp's word, at most `timeout` s; what hpc-ddp wrote on the
    control pipe (b"": it closed it), or None."""
    import select

    ready, _, _ = select.select([fd for fd in (control, wake) if fd is not None], [], [], timeout)
    if wake in ready:
        with contextlib.suppress(BlockingIOError):
            os.read(wake, 4096)
    return os.read(control, 64) if control in ready else None


def _signal_children(signum: int, skip: set[int] | None = None, outside_group: bool = False) -> None:
    """`signum` to each child of the supervisor (but those in `skip`, to which it adds them; with
    `outside_group`, only those that left the supervisor's process group)."""
    group = os.getpgrp()
    for pid in _children():
        if skip is not None and pid in skip:
            continue
        with contextlib.suppress(OSError):
            if outside_group and os.getpgid(pid) == group:
                continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
        if skip is not None:
            skip.add(pid)


def _children() -> list[int]:
    """The supervisor's own children: not reaped but by it, so their pids cannot be another's."""
    me = os.getpid()
    try:
        return [int(pid) for pid in Path(f"/proc/{me}/task/{me}/children").read_text().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: every process's parent, from its stat
        found = []
        for entry in Path("/proc").iterdir():
            stat = _proc_read(int(entry.name), "stat") if entry.name.isdigit() else None
            fields = stat[stat.rfind(b")") + 2:].split() if stat else []
            if len(fields) > 1 and fields[1] == str(me).encode():
                found.append(int(entry.name))
        return found


def _exit_as(status: int) -> NoReturn:
    """Exit as the command did: with its code, or killed by its signal (no core dump of our own)."""
    if os.WIFSIGNALED(status):
        import resource

        signum = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set, nor needs to be
            signal.signal(signum, signal.SIG_DFL)
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__" and sys.argv[1:2] == ["supervise"]:
    supervise(sys.argv[2:])
