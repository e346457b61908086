"""The debug rank's relay (`--debug-rank` with debugpy): the one way into that rank's debugger, open to the
job's owner alone.

debugpy has no authentication: whoever speaks DAP to it runs any code as the user, and on a shared node
other users can open connections to 127.0.0.1 too. So the debug rank never listens. It is started as
`python -m debugpy --connect 127.0.0.1:P --wait-for-client ...`, where P is a port this relay opened before
the rank started (`start`); the relay accepts there only a connection whose socket belongs to its own UID
(the peer's line in /proc/net/tcp), closes anything else, and stops listening once the rank is in. debugpy's
pydevd then speaks DAP itself over that connection: no adapter process, so no adapter port either.

The IDE reaches the relay only through what the owner alone can use:
- a Unix socket, mode 0600 in a 0700 directory of the user's on the node (`/tmp/hpc-ddp-UID`, refused if
  it is anything else), whose peer is checked by UID as well (SO_PEERCRED);
- under the local executor, also a loopback TCP port (--debug-port, or the first free from 5678), whose
  peer is checked by UID as above: a connection from another user is closed unanswered;
- from a login node, `hpc-ddp attach JOB` (debug.attach) serves a Unix socket of the same kind there
  and bridges each connection to the node's socket through `srun --jobid J --overlap -w NODE`, which runs
  `python -m hpc_ddp.job.debugrelay bridge SOCKET` (`bridge`; srun authenticates the user); `ssh -L
  PORT:SOCKET LOGIN` forwards a laptop's port to that socket.

One IDE at a time: another connection while one is attached is closed. An IDE may leave and another attach
later. The relay ends when the rank does (its connection closes, or its parent, the rank, is gone), and
only then: it ignores the signals sent to the rank's process group (the warning signal, SIGTERM, SIGINT).

`python -m hpc_ddp.job.debugrelay serve ...` is the relay, `... bridge SOCKET` the srun end; everything
else here is small socket helpers.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hpc_ddp.common.errors import EnvError

__all__ = ["FIRST_PORT", "Ready", "bridge", "decode_line", "login_socket_path", "listen_tcp", "listen_unix", "main",
           "node_socket_path", "owner_only", "peer_uid", "private_dir", "serve", "start"]

FIRST_PORT = 5678            # debugpy's own default: what VS Code's "attach" configuration fills in
_PORT_TRIES = 50
_LOOPBACK = "127.0.0.1"
_CHUNK = 1 << 16
_ENDS_WITH_THE_RANK = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_ROOT = "/tmp"


def private_dir_path(uid: int | None = None, root: str = _ROOT) -> Path:
    """Where this user's debug sockets live on a machine: /tmp/hpc-ddp-UID (short: a socket path has at
    most 107 bytes)."""
    return Path(root) / f"hpc-ddp-{os.getuid() if uid is None else uid}"


def private_dir(root: str = _ROOT) -> Path:
    """private_dir_path, made 0700, or an existing one checked: a directory (not a link), ours, with no
    access for group or others. Anything else is refused: another user may have made it to catch our
    sockets."""
    path = private_dir_path(root=root)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise EnvError(f"{path} is not a private directory of yours (a directory you own, mode 0700), so the "
                       "debugger's socket cannot be made there", hint=f"remove {path}, or ask an admin to")
    return path


def _safe(job_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", str(job_id))[:40] or "job"


def node_socket_path(job_id: str, rank: int, uid: int | None = None) -> str:
    """The relay's socket on the debug rank's node."""
    return str(private_dir_path(uid) / f"rank-{_safe(job_id)}-{rank}.sock")


def login_socket_path(job_id: str, rank: int, uid: int | None = None) -> str:
    """`hpc-ddp attach`'s socket on the login node (another name than the node's: they may be one machine)."""
    return str(private_dir_path(uid) / f"attach-{_safe(job_id)}-{rank}.sock")


def listen_unix(path: str) -> socket.socket:
    """A listening Unix socket at `path`, mode 0600 from the moment it exists, in a private_dir. A stale
    socket of an earlier attempt there is replaced; a live one (another relay) is refused."""
    if os.path.dirname(path) != str(private_dir(str(Path(path).parent.parent))):
        raise EnvError(f"{path}: a debug socket must be in {private_dir_path()}")
    _remove_stale(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(8)
    return sock


def _remove_stale(path: str) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise EnvError(f"{path} exists and is not a socket", hint=f"remove {path}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nothing serves it: left by a relay that was killed
            return
    raise EnvError(f"{path} is in use: another relay for this rank is running",
                   hint="stop the other `hpc-ddp attach` for this job first")


def listen_tcp(port: int | None) -> socket.socket:
    """A listening socket on 127.0.0.1: at `port` (taken: an EnvError), or at the first free port from
    FIRST_PORT when `port` is None."""
    for candidate in ([port] if port is not None else range(FIRST_PORT, FIRST_PORT + _PORT_TRIES)):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((_LOOPBACK, candidate))
        except OSError:
            sock.close()
            continue
        sock.listen(8)
        return sock
    which = f"--debug-port {port} is" if port is not None else f"every port from {FIRST_PORT} to " \
                                                               f"{FIRST_PORT + _PORT_TRIES - 1} is"
    raise EnvError(f"{which} already in use on {socket.gethostname()}",
                   hint="choose another --debug-port, or leave it out to take the first free one from 5678")


def _proc_net_address(address: tuple[str, int]) -> str:
    """An IPv4 (host, port) as /proc/net/tcp writes it: the address as the kernel's u32, in this machine's
    byte order, and the port, both in hex."""
    host, port = address[0], address[1]
    return f"{struct.unpack('=I', socket.inet_aton(host))[0]:08X}:{port:04X}"


def peer_uid(conn: socket.socket, proc_net_tcp: str = "/proc/net/tcp") -> int | None:
    """The UID that owns the other end of `conn`: SO_PEERCRED for a Unix socket; for a loopback TCP
    connection the `uid` column of the peer's own line in /proc/net/tcp (its local address is our peer, its
    remote address us). None where it cannot be told: the caller refuses then."""
    if conn.family == socket.AF_UNIX:
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
        return uid
    try:
        theirs, ours = _proc_net_address(conn.getpeername()), _proc_net_address(conn.getsockname())
        with open(proc_net_tcp, encoding="ascii") as table:
            lines = table.read().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 7 and fields[1] == theirs and fields[2] == ours:
            return int(fields[7])
    return None


def owner_only(conn: socket.socket, say=None) -> bool:
    """Is the peer of `conn` this process's user? If not, `conn` is closed (nothing was read from it or
    written to it) and `say` told."""
    uid = peer_uid(conn)
    if uid == os.getuid():
        return True
    if say is not None:
        say(f"refused a connection from uid {uid if uid is not None else 'unknown'}: only uid {os.getuid()} "
            "may reach this debugger")
    conn.close()
    return False


@dataclass
class _Relay:
    """The relay's sockets: the rank's listener (until the rank is in), the IDE's listeners, and the two
    ends it joins."""
    rank_listener: socket.socket | None
    ide_listeners: list[socket.socket]
    parent: int
    say: object
    rank: socket.socket | None = None
    ide: socket.socket | None = None
    held: list[bytes] = field(default_factory=list)  # what the rank sent before the first IDE came
    attached: bool = False  # an IDE came (what the rank sends between two IDEs was the last one's)

    def readable(self) -> list[socket.socket]:
        ends = [s for s in (self.rank_listener, self.rank) if s is not None] + self.ide_listeners
        if self.ide is not None and self.rank is not None:  # the IDE's requests wait until the rank is in
            ends.append(self.ide)
        return ends

    def on_rank_listener(self) -> None:
        conn, _ = self.rank_listener.accept()
        if owner_only(conn, self.say):
            self.rank = conn
            self.rank_listener.close()
            self.rank_listener = None

    def on_ide_listener(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        if not owner_only(conn, self.say):
            return
        if self.ide is not None:
            self.say("refused a second debugger: one is attached already")
            conn.close()
            return
        self.ide, self.attached = conn, True
        for chunk in self.held:
            self._to_ide(chunk)
        self.held.clear()

    def on_rank(self) -> bool:
        """Pass what the rank sent on; False once it closed (the rank ended)."""
        try:
            data = self.rank.recv(_CHUNK)
        except OSError:
            return False
        if not data:
            return False
        if self.ide is not None:
            self._to_ide(data)
        elif not self.attached and sum(map(len, self.held)) < (16 << 20):
            self.held.append(data)
        return True

    def on_ide(self) -> bool:
        """Pass what the IDE sent on; False once the rank cannot take it (it ended)."""
        try:
            data = self.ide.recv(_CHUNK)
        except OSError:
            data = b""
        if not data:
            self._drop_ide()
            return True
        try:
            self.rank.sendall(data)
        except OSError:
            return False
        return True

    def _to_ide(self, data: bytes) -> None:
        try:
            self.ide.sendall(data)
        except OSError:
            self._drop_ide()

    def _drop_ide(self) -> None:
        self.ide.close()
        self.ide = None

    def close(self) -> None:
        for sock in (self.rank_listener, self.rank, self.ide, *self.ide_listeners):
            if sock is not None:
                sock.close()


def serve(relay: _Relay) -> None:
    """Join the rank and the IDE until the rank ends (its connection closes, or its process is gone)."""
    while os.getppid() == relay.parent:
        ready, _, _ = select.select(relay.readable(), [], [], 1.0)
        for sock in ready:
            if sock is relay.rank_listener:
                relay.on_rank_listener()
            elif sock in relay.ide_listeners:
                relay.on_ide_listener(sock)
            elif sock is relay.rank:
                if not relay.on_rank():
                    return
            elif sock is relay.ide:
                if not relay.on_ide():
                    return


def bridge(path: str) -> int:
    """The srun end (`hpc-ddp attach` runs it on the node): this process's stdin and stdout joined to the
    relay's Unix socket at `path`, until either side closes. What the rank sends goes out as one base64 line
    per chunk (`decode_line` undoes it): srun passes a task's output on line by line, and DAP messages do not
    end in a newline. stdin is passed on as it comes."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(path)
        except OSError as exc:
            print(f"hpc-ddp: cannot reach the debugger at {path} on {socket.gethostname()}: "
                  f"{exc.strerror or exc}", file=sys.stderr, flush=True)
            return 1
        stdin_open = True
        while True:
            ready, _, _ = select.select([sock, 0] if stdin_open else [sock], [], [])
            if sock in ready:
                data = sock.recv(_CHUNK)
                if not data:
                    return 0
                _write_all(1, base64.b64encode(data) + b"\n")
            if 0 in ready:
                data = os.read(0, _CHUNK)
                if data:
                    sock.sendall(data)
                else:  # the IDE left: the relay sees it, and closes its end
                    stdin_open = False
                    sock.shutdown(socket.SHUT_WR)


def decode_line(line: bytes) -> bytes:
    """What one line of `bridge`'s output carries (b"" for a line that is not base64: srun's own words)."""
    try:
        return base64.b64decode(line.strip(), validate=True)
    except ValueError:
        return b""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@dataclass(frozen=True)
class Ready:
    """What the relay reports once it listens: the port the rank connects to, the IDE's port (local
    executor) and socket."""
    rank_port: int
    ide_port: int | None
    socket: str


def start(socket_path: str, ide_port: int | None, local: bool) -> Ready:
    """Start the relay (a child of this process, which then becomes the rank by exec) and wait until it
    listens. `local`: also a loopback TCP port for the IDE, at `ide_port` or the first free from 5678."""
    argv = [sys.executable, "-m", "hpc_ddp.job.debugrelay", "serve", "--socket", socket_path,
            "--parent", str(os.getpid())]
    if local:
        argv += ["--ide-port", str(ide_port) if ide_port is not None else "auto"]
    # The relay ends with the rank, not before: the warning signal, a cancel's SIGTERM and Ctrl-C go to the
    # rank's whole process group, and the rank may take a while to checkpoint on them, in the debugger.
    # Ignored from the fork on (the disposition is inherited), so none can come before the relay's own start.
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _ENDS_WITH_THE_RANK}
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, close_fds=True)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    with proc.stdout:
        line = proc.stdout.readline()
    try:
        ready = json.loads(line)
    except ValueError:
        ready = {"error": f"the debug relay did not start (exit code {proc.wait()})"}
    if "error" in ready:
        raise EnvError(ready["error"], hint=ready.get("hint"))
    return Ready(ready["rank_port"], ready.get("ide_port"), ready["socket"])


def _listen(args: argparse.Namespace) -> tuple[_Relay, Ready]:
    ide = [listen_unix(args.socket)]
    if args.ide_port is not None:
        ide.append(listen_tcp(None if args.ide_port == "auto" else int(args.ide_port)))
    rank_listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    rank_listener.bind((_LOOPBACK, 0))
    rank_listener.listen(8)

    def say(message: str) -> None:
        print(f"hpc-ddp: debug relay: {message}", file=sys.stderr, flush=True)

    relay = _Relay(rank_listener, ide, args.parent, say)
    return relay, Ready(rank_listener.getsockname()[1], ide[1].getsockname()[1] if len(ide) > 1 else None,
                        args.socket)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.job.debugrelay")
    commands = parser.add_subparsers(dest="command", required=True)
    relay = commands.add_parser("serve", help="the relay beside the debug rank (the runner starts it)")
    relay.add_argument("--socket", required=True)
    relay.add_argument("--parent", type=int, required=True)
    relay.add_argument("--ide-port")
    end = commands.add_parser("bridge", help="stdin/stdout to the relay's socket (hpc-ddp attach runs it)")
    end.add_argument("socket")
    args = parser.parse_args(argv)
    if args.command == "bridge":
        return bridge(args.socket)
    return _serve_main(args)


def _serve_main(args: argparse.Namespace) -> int:
    """Listen, report where (one JSON line on stdout, then stdout is closed), relay until the rank ends."""
    for sig in _ENDS_WITH_THE_RANK:
        signal.signal(sig, signal.SIG_IGN)
    try:
        relay, ready = _listen(args)
    except EnvError as exc:
        print(json.dumps({"error": exc.message, "hint": exc.hint}), flush=True)
        return 1
    print(json.dumps({"rank_port": ready.rank_port, "ide_port": ready.ide_port, "socket": ready.socket}),
          flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    try:
        serve(relay)
    finally:
        relay.close()
        try:
            os.unlink(args.socket)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
