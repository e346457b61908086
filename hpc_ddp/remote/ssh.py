"""One cluster reached over the system's OpenSSH, with the user's own ~/.ssh/config (ProxyJump, keys,
agent): every command of a session shares one connection (ControlMaster, its socket in a private folder of
ours), so a site that asks for a password and a one-time code asks once, not once per command.

What ssh says when it cannot connect becomes one line with the fix (`classify`): the host unknown or
unreachable, authentication refused, a changed host key. `Ssh.run` is the one edge; tests fake it or
point it at a real sshd on a loopback port (HPC_DDP_SSH_CONFIG: an ssh_config file instead of
~/.ssh/config).

Every call that waits on the cluster has a bound, set here and nowhere else (`Ssh.bounded`, `Ssh.stream`):
ssh gives up a connection not made within ConnectTimeout and one that stops answering after
ServerAliveInterval x ServerAliveCountMax; each call (ssh, rsync or tar through it) is ended after
`timeout_s` of wall clock whatever it waits on (a remote command that hangs, a pipe that never closes);
and a control call (the probe, status, cancel, list, ...) after `silence_s` without a byte of output,
the cluster's submit after SUBMIT_SILENCE_S. Each is said in one line: the connection was lost.
HPC_DDP_SSH_TIMEOUT_S sets the first bound (default 900 s), HPC_DDP_SSH_SILENCE_S the second (90 s).

A remote command is a POSIX sh script sent on ssh's standard input to `sh -s`, so the cluster account's
login shell (bash, zsh, tcsh) never parses our quoting.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.common.errors import HpcDdpError, UserError

__all__ = ["Ssh", "Done", "check_host", "classify", "control_dir", "call_bound", "raise_if_lost", "unbounded", "SSH_FAILED"]

SSH_FAILED = 255           # ssh's own exit code: it could not connect (or the remote command exited 255)
PERSIST_S = 600            # the shared connection stays this long after its last command
CONNECT_S = 30             # ssh's ConnectTimeout: a connection not made by then fails
CALL_S = 900.0             # the wall-clock bound of one call over ssh (HPC_DDP_SSH_TIMEOUT_S overrides)
SILENCE_S = 90.0           # a control call (probe, status, cancel, ...) silent this long is lost (HPC_DDP_SSH_SILENCE_S)
SUBMIT_SILENCE_S = 300.0   # the cluster's own submit, which may import torch from a cold filesystem first
# `bounded(..., timeout=SELF_BOUNDED)`: no wall clock, for a command that bounds its own waits: rsync with
# --timeout (no data moved for that long) copies a big project over a slow link for as long as data moves.
# With `silence=S` too, it is ended after S seconds without a byte of output (rsync's --info=progress2
# prints as data moves): an rsync whose own timeout fired but which waits on its remote shell forever.
SELF_BOUNDED = -1.0
DRAIN_S = 2.0              # once a call's process has ended: how long its output may still take to be read
# [user@]host, where host is a name (an alias of ~/.ssh/config, a DNS name, an IPv4 address) or an IPv6
# address in brackets. No ':' outside brackets: rsync reads HOST:PATH at the first colon (and HOST::MODULE as
# its daemon), so "login:/tmp" or "::1" would send the project somewhere else than ssh connects to.
_HOST = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.+%-]{0,63}@)?"
                   r"(?:\[[0-9A-Fa-f:.]{2,45}(?:%[A-Za-z0-9_.-]{1,32})?\]|[A-Za-z0-9_][A-Za-z0-9_.-]{0,252})")


def check_host(host: object) -> str:
    """A host as ssh and rsync both take it (an alias of ~/.ssh/config, host, user@host, [IPv6]); never one
    that ssh would read as an option (`-oProxyCommand=...`), that holds a space, a quote or a control
    character, or that rsync would split at a colon."""
    if not isinstance(host, str) or not _HOST.fullmatch(host):
        shown = repr(host) if isinstance(host, str) else f"{host!r} (a {type(host).__name__})"
        raise UserError(f"{shown} is not a host name ssh can be given",
                        hint="give a Host alias of ~/.ssh/config, user@host.example.org, or [IPv6 address]")
    return host


# A socket's path must fit 104 bytes (macOS; 108 on Linux); ssh names it FOLDER/<40 hex digits> and first
# makes it as that name + a 17-character temporary suffix.
_SOCKET_ROOM = 104 - 1 - 40 - 17


def control_dir(env: Mapping[str, str] = os.environ) -> Path:
    """The private folder of the shared connections' sockets: $HPC_DDP_SSH_CONTROL_DIR, else
    $XDG_RUNTIME_DIR/hpc-ddp-ssh, else ~/.ssh/hpc-ddp; where that path is too long for a socket,
    /tmp/hpc-ddp-ssh-UID. Made 0700; one that is not ours, or a link, or open to others is refused
    (another user's socket there would carry our commands)."""
    base = env.get("HPC_DDP_SSH_CONTROL_DIR")
    if base:
        path = Path(base)
    elif env.get("XDG_RUNTIME_DIR") and os.path.isdir(env["XDG_RUNTIME_DIR"]):
        path = Path(env["XDG_RUNTIME_DIR"]) / "hpc-ddp-ssh"
    else:
        path = Path.home() / ".ssh" / "hpc-ddp"
    if len(os.fsencode(str(path))) > _SOCKET_ROOM:
        if base:
            raise UserError(f"HPC_DDP_SSH_CONTROL_DIR={base} is too long a path for ssh's socket in it",
                            hint=f"give a folder of at most {_SOCKET_ROOM} bytes, e.g. /tmp/hpc-ddp-ssh-{os.getuid()}")
        path = Path(f"/tmp/hpc-ddp-ssh-{os.getuid()}")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise UserError(f"{path} is not a private folder of yours (it holds the ssh connection hpc-ddp shares)",
                        hint="remove it (hpc-ddp makes it again, mode 0700), or set HPC_DDP_SSH_CONTROL_DIR")
    return path


@dataclasses.dataclass(frozen=True)
class Done:
    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def text(self) -> str:
        return self.stdout.decode(errors="replace")


class Ssh:
    """ssh to one host, every command through the same shared connection."""

    def __init__(self, host: str, env: Mapping[str, str] = os.environ) -> None:
        self.host = check_host(host)
        self.config = env.get("HPC_DDP_SSH_CONFIG") or None
        self.sockets = control_dir(env)
        self.timeout_s = call_bound(env)
        self.silence_s = call_bound(env, "HPC_DDP_SSH_SILENCE_S", SILENCE_S)

    def options(self) -> list[str]:
        """ssh's options, also for rsync's -e: the shared connection; a connection not made within
        CONNECT_S fails, and keep-alives notice a dropped link within a minute instead of hanging."""
        opts = ["-o", "ControlMaster=auto", "-o", f"ControlPath={self.sockets}/%C",
                "-o", f"ControlPersist={PERSIST_S}", "-o", f"ConnectTimeout={CONNECT_S}",
                "-o", "ServerAliveInterval=15", "-o", "ServerAliveCountMax=4"]
        return (["-F", self.config] if self.config else []) + opts

    def argv(self, remote: str = "sh -s") -> list[str]:
        return ["ssh", *self.options(), "--", self.host, remote]

    def rsh(self) -> str:
        """rsync's -e: the same ssh, the same connection."""
        return shlex.join(["ssh", *self.options()])

    def lost(self, timeout: float, silent: bool = False) -> UserError:
        """The one line for a call that outlived its bound (`silent`: its bound of silence)."""
        said, name = ("said nothing for", "HPC_DDP_SSH_SILENCE_S") if silent else ("no answer within", "HPC_DDP_SSH_TIMEOUT_S")
        return UserError(f"the connection to {self.host} was lost: {said} {timeout:g} s",
                         hint=f"check that ssh {self.host} works by hand, then run the command again "
                              f"({name} sets the bound)")

    def bounded(self, argv: list[str], *, input: bytes | None = None, stdin=None,
                timeout: float | None = None, silence: float | None = None) -> Done:
        """Run a command that waits on the cluster (ssh, or rsync and tar through it), its output captured,
        ended after `timeout` (default: this host's bound) with a UserError that says the connection was lost.
        The bound is on the process, never on its pipes: a child it leaves behind holding them (a
        ProxyCommand's, rsync's remote shell) cannot hold the call past it (`_Captured`)."""
        limit = timeout if timeout is not None else self.timeout_s
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else stdin,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except FileNotFoundError:
            raise UserError(f"there is no {os.path.basename(argv[0])} on this machine",
                            hint="install OpenSSH's client" if argv[0] == "ssh" else f"install {argv[0]}") from None
        captured = _Captured(proc, input)
        deadline = None if limit == SELF_BOUNDED else time.monotonic() + limit
        while True:
            try:
                code = proc.wait(timeout=1.0 if silence else None if deadline is None
                                 else max(0.0, deadline - time.monotonic()))
                break
            except subprocess.TimeoutExpired:
                quiet = silence is not None and time.monotonic() - captured.last > silence
                if quiet or (deadline is not None and time.monotonic() >= deadline):
                    proc.kill()
                    proc.wait()
                    captured.finish()
                    raise self.lost(silence if quiet else limit, silent=quiet) from None
        out, err = captured.finish()
        return Done(code, out, err)

    def run(self, script: str, *, check: bool = True, timeout: float | None = None,
            silence: float | None = None) -> Done:
        """Run a POSIX sh script on the host; its output, captured, within `timeout` and ended after
        `silence` (default: this host's silence_s) without a byte of output (`bounded`). A failure to connect
        is one line (`classify`); with `check`, so is a script that fails."""
        done = result = self.bounded(self.argv(), input=script.encode(errors="surrogateescape"), timeout=timeout,
                                     silence=self.silence_s if silence is None else silence)
        if done.returncode == SSH_FAILED:
            raise classify(self.host, done.stderr.decode(errors="replace"))
        if done.returncode < 0:
            raise killed(self.host, done.returncode)
        if check and done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip().splitlines()
            raise HpcDdpError(f"on {self.host}: {said[-1] if said else f'exit code {done.returncode}'}")
        return result

    def stream(self, script: str) -> subprocess.Popen:
        """Start a script whose output the caller reads as it comes; its stderr passes through. It is killed
        after this host's bound (`raise_if_lost(proc)` then says so), unless the caller lifts the bound
        (`unbounded(proc)`: logs -f follows as long as the user wants, the keep-alives notice a dead link)."""
        try:
            proc = subprocess.Popen(self.argv(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        except FileNotFoundError:
            raise UserError("there is no ssh on this machine", hint="install OpenSSH's client") from None
        timer = threading.Timer(self.timeout_s, _overrun, (proc, self.lost(self.timeout_s)))
        timer.daemon = True
        proc.hpc_ddp_timer = timer  # type: ignore[attr-defined]
        timer.start()
        assert proc.stdin is not None
        try:
            proc.stdin.write(script.encode(errors="surrogateescape"))
            proc.stdin.close()
        except BrokenPipeError:
            pass  # ssh is gone already: its exit code says why
        return proc

    def close(self) -> None:
        """End the shared connection now (its commands are done)."""
        try:
            self.bounded(["ssh", *self.options(), "-O", "exit", "--", self.host], timeout=min(10.0, self.timeout_s))
        except UserError:
            pass  # the master is gone or hangs: it ends by itself after ControlPersist


class _Captured:
    """A process's stdout and stderr read by threads of their own (and its input written by one), so that
    the caller waits on the process, not on pipes. `finish`, once it has ended: what was read, after at
    most DRAIN_S more for what is still in the pipes; a pipe a leftover child keeps open is left to it."""

    def __init__(self, proc: subprocess.Popen, input: bytes | None) -> None:
        self.parts: dict[str, list[bytes]] = {"out": [], "err": []}
        self.last = time.monotonic()  # when the last output came
        self.threads = [threading.Thread(target=self._read, args=(proc.stdout, self.parts["out"]), daemon=True),
                        threading.Thread(target=self._read, args=(proc.stderr, self.parts["err"]), daemon=True)]
        if input is not None:
            self.threads.append(threading.Thread(target=_write_all, args=(proc.stdin, input), daemon=True))
        for thread in self.threads:
            thread.start()

    def finish(self) -> tuple[bytes, bytes]:
        deadline = time.monotonic() + DRAIN_S
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return b"".join(self.parts["out"]), b"".join(self.parts["err"])

    def _read(self, stream, into: list[bytes]) -> None:
        try:
            for chunk in iter(lambda: stream.read1(65536), b""):
                into.append(chunk)
                self.last = time.monotonic()
        except (OSError, ValueError):
            pass


def _write_all(stream, data: bytes) -> None:
    try:
        stream.write(data)
        stream.close()
    except (OSError, ValueError):
        pass  # the process is gone, or stopped reading: its exit code says why


def _overrun(proc: subprocess.Popen, lost: UserError) -> None:
    if proc.poll() is None:
        proc.hpc_ddp_lost = lost  # type: ignore[attr-defined]
        proc.kill()


def unbounded(proc: Any) -> None:
    """Lift `Ssh.stream`'s bound from `proc` (a call that follows for as long as the user wants)."""
    timer = getattr(proc, "hpc_ddp_timer", None)
    if timer is not None:
        timer.cancel()


def raise_if_lost(proc: Any) -> None:
    """Raise the one line of a streamed call that its bound ended; cancel the bound of one that ended."""
    unbounded(proc)
    lost = getattr(proc, "hpc_ddp_lost", None)
    if lost is not None:
        raise lost


def call_bound(env: Mapping[str, str] = os.environ, name: str = "HPC_DDP_SSH_TIMEOUT_S",
               default: float = CALL_S) -> float:
    """A bound of the calls over ssh in seconds: `name` from the environment, else `default` (the wall-clock
    bound of one call: HPC_DDP_SSH_TIMEOUT_S, CALL_S)."""
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
        if not 0 < value < 1e7:
            raise ValueError
    except ValueError:
        raise UserError(f"{name}={raw!r} is not a number of seconds",
                        hint=f"give a positive number, e.g. {name}={default:g}") from None
    return value


# ssh's words (OpenSSH 7-9) -> what went wrong, and the fix.
_FAILURES = (
    ("REMOTE HOST IDENTIFICATION HAS CHANGED", "the host key of {host} changed since you last connected: ssh "
     "refuses to connect (the cluster's key was replaced, or someone is in the middle)",
     "if the cluster's admins announced a new key, remove the old one (ssh-keygen -R HOST) and connect once "
     "by hand (ssh {host}) to check and accept the new one; otherwise do not connect"),
    ("Host key verification failed", "ssh could not verify the host key of {host}",
     "connect once by hand (ssh {host}) to check and accept its key"),
    ("Could not resolve hostname", "ssh cannot resolve the host {host}",
     "check the name, or add a Host block for it to ~/.ssh/config"),
    ("Permission denied", "{host} refused the login (ssh: permission denied)",
     "check that ssh {host} works by hand: the user name (user@host or User in ~/.ssh/config), the key "
     "(ssh-add -l) or the password"),
    ("Too many authentication failures", "{host} refused the login (too many authentication failures)",
     "name the key for it (IdentityFile and IdentitiesOnly yes in ~/.ssh/config)"),
    ("Connection refused", "{host} refused the connection (no ssh server listens there, or not on that port)",
     "check the host and port (Port in ~/.ssh/config), or the VPN"),
    ("Connection timed out", "{host} did not answer (connection timed out)",
     "check the network or VPN, and ProxyJump in ~/.ssh/config if the cluster sits behind a gateway"),
    ("No route to host", "{host} cannot be reached (no route to host)", "check the network or VPN"),
    ("Network is unreachable", "{host} cannot be reached (network unreachable)", "check the network or VPN"),
    ("Connection closed by", "{host} closed the connection before the login ended",
     "check that ssh {host} works by hand"),
    ("Connection reset by", "{host} reset the connection", "check that ssh {host} works by hand"),
)


def killed(host: str, returncode: int) -> UserError:
    """ssh itself ended by a signal here (the OOM killer, a kill of its process group): one line. A remote
    command's signal comes back as an exit code of 128 + N, never as this."""
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return UserError(f"ssh to {host} was killed by {name} on this machine before the cluster answered",
                     hint=f"run the command again; if it happens again, check that ssh {host} works by hand")


def classify(host: str, stderr: str) -> UserError:
    """ssh's failure to connect (exit 255) as one line with its fix."""
    for needle, message, hint in _FAILURES:
        if needle in stderr:
            return UserError(message.format(host=host), hint=hint.format(host=host))
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    last = lines[-1] if lines else "ssh exited with 255"
    return UserError(f"ssh to {host} failed: {last}", hint=f"check that ssh {host} works by hand")
