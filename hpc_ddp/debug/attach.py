"""`hpc-ddp attach JOB`: this machine's end of the way to a debug rank (--debug-rank), for its owner alone.

The rank's debugger is reachable only through its relay's Unix socket on its node (job.debugrelay). Here,
on the login node, `attach` serves a socket of the same kind (mode 0600 in the user's 0700
/tmp/hpc-ddp-UID, peer checked by UID) and, optionally, a loopback port whose peer is checked by UID (for
an IDE on this machine, e.g. VS Code Remote-SSH). Each connection is joined to the node's socket through
`srun --jobid J --overlap -w NODE -N1 -n1 PYTHON -m hpc_ddp.job.debugrelay bridge SOCKET`: srun
authenticates the user (munge) and runs the bridge as them on the node, so nobody else gets through. A run
of the local executor is on this machine: the bridge runs directly.

A laptop reaches this socket with `ssh -N -L PORT:SOCKET LOGIN` (printed), then attaches the IDE to
localhost:PORT. One debugger session at a time; `attach` ends when the rank no longer waits (the attempt
ended) or on Ctrl-C.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

from hpc_ddp.job.debugrelay import decode_line, listen_tcp, listen_unix, login_socket_path, owner_only

__all__ = ["bridge_command", "intro_lines", "serve"]


def bridge_command(event: Mapping[str, Any], python: str) -> list[str]:
    """The command whose stdin/stdout reach the rank's relay: through srun into the job on its node, or
    directly for a run of the local executor (this machine). `python` is the caller's choice (the run's
    own interpreter as its spec names it, or this hpc-ddp's): never the event's, which the ranks wrote and
    anything that can write to events.jsonl could make name a program to run here."""
    end = [python, "-m", "hpc_ddp.job.debugrelay", "bridge", "--", str(event["socket"])]
    if event.get("loopback"):
        return end
    return ["srun", "--jobid", str(event["slurm_job_id"]), "--overlap", "-w", str(event["node"]), "-N1", "-n1",
            "--quiet", *end]


def socket_path(event: Mapping[str, Any]) -> str:
    """Where `attach` serves on this machine (what the rank's log and status print for a cluster's job)."""
    return str(event.get("login_socket") or login_socket_path(str(event["job_id"]), int(event["rank"])))


def intro_lines(event: Mapping[str, Any], path: str, port: int | None, login: str) -> list[str]:
    """What `attach` says once it serves: the exact commands to attach from a laptop, and from here."""
    laptop = int(event.get("port") or 5678)
    lines = [f"hpc-ddp: relaying to rank {event['rank']} of job {event['job_id']} on {event['node']}, for uid "
             f"{os.getuid()} only; Ctrl-C stops",
             f"hpc-ddp: from your laptop: ssh -N -L {laptop}:{path} {login}  then attach VS Code or PyCharm to "
             f"localhost:{laptop}"]
    if port is not None:
        lines.append(f"hpc-ddp: on this machine: attach VS Code or PyCharm to localhost:{port}")
    return lines


def serve(event: Mapping[str, Any], *, port: int | None, current: Callable[[], Mapping[str, Any] | None],
          say: Callable[[str], None], poll_s: float | None = None, python: str = sys.executable) -> None:
    """Serve the owner's debugger sessions, one at a time, until the rank no longer waits. `current()`: the
    debugger event of the run's current attempt (None: none waits), asked after each session and every
    `poll_s` seconds while none runs (2 s for a local run, 10 s where asking means asking Slurm); a requeued
    job's rank may wait on another node, and the next session goes there."""
    poll_s = poll_s if poll_s is not None else 2.0 if event.get("loopback") else 10.0
    path = socket_path(event)
    listeners = [listen_unix(path)]
    try:
        if port is not None:
            listeners.append(listen_tcp(port))
        for line in intro_lines(event, path, port, socket.gethostname()):
            say(line)
        while True:
            ready, _, _ = select.select(listeners, [], [], poll_s)
            for listener in ready:
                conn, _ = listener.accept()
                if owner_only(conn, lambda m: say(f"hpc-ddp: attach: {m}")):
                    _session(conn, bridge_command(event, python), say)
            now = current()
            if now is None or (now.get("job_id"), now.get("rank")) != (event.get("job_id"), event.get("rank")):
                say(f"hpc-ddp: rank {event['rank']} of job {event['job_id']} no longer waits for a debugger; "
                    "attach ends")
                return
            event = now
    finally:
        for listener in listeners:
            listener.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def _session(conn: socket.socket, command: list[str], say: Callable[[str], None]) -> None:
    """One debugger session: the connection is the bridge's stdin; its output lines, decoded, go back to
    the connection; until either side closes."""
    say("hpc-ddp: a debugger attached")
    with conn:
        try:
            proc = subprocess.Popen(command, stdin=conn.fileno(), stdout=subprocess.PIPE)
        except OSError as exc:
            say(f"hpc-ddp: attach: cannot run {command[0]}: {exc.strerror or exc}")
            return
        with proc.stdout:
            try:
                for line in proc.stdout:
                    conn.sendall(decode_line(line))
            except OSError:  # the debugger went away: the bridge sees its stdin close, and ends
                pass
        try:
            conn.shutdown(socket.SHUT_RDWR)  # the bridge's stdin ends too, where the debugger's side failed
        except OSError:
            pass
    code = proc.wait()
    say("hpc-ddp: the debugger left" if code == 0 else f"hpc-ddp: the relay to the rank ended with exit code {code}")
