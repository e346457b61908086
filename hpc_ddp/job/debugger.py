"""A debugger on one chosen rank (`hpc-ddp submit --debug-rank R`): where it listens, what it prints, how
its program is started, and how long the other ranks wait for it.

The runner calls `wrap` on every rank; only rank R changes: its program starts under debugpy
(`python -m debugpy --listen HOST:PORT --wait-for-client ...`, the protocol VS Code and PyCharm speak) or,
under the local executor with --pdb, under pdb with the terminal as its stdin. The same process runs the
program (no child), so the warning signal still reaches it and a Session still checkpoints on it.

Where it listens, and who can reach it: debugpy has no authentication, and whoever connects first may run
any code as the job's user. Under the local executor it binds 127.0.0.1 (this machine only). On a cluster
it binds the compute node's own address (never 0.0.0.0), because the tunnel from a laptop goes through the
login node to NODE:PORT; until a debugger attaches, anyone who can open a connection to that node (the
cluster's internal network) could attach first. The log line says so.

Everything but `wrap`'s port probe and `debugpy_missing` is pure.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from hpc_ddp.common.errors import EnvError, UserError
from hpc_ddp.job.ports import first_free_port, port_in_use

__all__ = ["DEBUGGERS", "DEBUG_TIMEOUT_S", "DEFAULT_PORT", "INSTALL_HINT", "check_debugpy", "debug_argv",
           "debugpy_missing", "listen_host", "log_lines", "record", "refuse_missing_debugpy", "stretched", "tunnel_command", "wrap"]

DEFAULT_PORT = 5678          # debugpy's own default: what VS Code's "attach" configuration fills in
DEBUGGERS = ("debugpy", "pdb")
# While a rank may sit at a breakpoint the others wait in a collective (or at the rendezvous, for a rank
# that waits for its debugger before it starts): a day, rather than the minutes that catch a hung job.
DEBUG_TIMEOUT_S = 86400
INSTALL_HINT = "pip install 'hpc-ddp[debug]' (it installs debugpy) into the Python the ranks run"
_LOOPBACK = "127.0.0.1"


def stretched(timeout_s: int) -> int:
    """A timeout while a debugger may be attached: at least DEBUG_TIMEOUT_S, a longer one kept."""
    return max(timeout_s, DEBUG_TIMEOUT_S)


def tunnel_command(node: str, port: int, login: str) -> str:
    """What to run on a laptop so that localhost:PORT reaches NODE:PORT through the login node."""
    return f"ssh -N -L {port}:{node}:{port} {login}"


def listen_host(env: Mapping[str, str]) -> tuple[str, str]:
    """(address to bind, node name to tunnel to): loopback under the local executor, else this node's own
    address (see the module docstring for who can reach it)."""
    if env.get("HPC_DDP_LOCAL"):
        return _LOOPBACK, _LOOPBACK
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        return socket.gethostbyname(node), node
    except OSError:
        return _LOOPBACK, node  # a name that does not resolve: only a debugger on the node itself can attach


def debug_argv(argv: list[str], debugger: str, host: str, port: int) -> list[str]:
    """The program's argv ([python, script | -m module, args...]) started under the debugger instead."""
    python, rest = argv[0], argv[1:]
    if debugger == "pdb":
        return [python, "-m", "pdb", *rest]
    # Frozen stdlib modules (3.11+) can make debugpy miss breakpoints (it warns in the log): off, as it advises.
    return [python, "-Xfrozen_modules=off", "-m", "debugpy", "--listen", f"{host}:{port}", "--wait-for-client", *rest]


def record(rank: int, debugger: str, host: str, node: str, port: int, login: str,
           rendezvous_timeout: int, collective_timeout: int) -> dict[str, Any]:
    """The `debugger` event (events.jsonl) that `hpc-ddp status` shows. `login`: the machine a laptop can
    ssh to (the submit host on a cluster; this machine under the local executor)."""
    out: dict[str, Any] = {"event": "debugger", "rank": rank, "debugger": debugger,
                           "rendezvous_timeout": rendezvous_timeout, "collective_timeout": collective_timeout}
    if debugger == "debugpy":
        out.update(listen=f"{host}:{port}", node=node, port=port, tunnel=tunnel_command(node, port, login),
                   loopback=host == _LOOPBACK)
    return out


def log_lines(rec: Mapping[str, Any]) -> list[str]:
    """What the rank prints in its log before it waits."""
    timeouts = (f"rendezvous and collective timeouts stretched to {rec['rendezvous_timeout']} s and "
                f"{rec['collective_timeout']} s while it may be stopped")
    if rec["debugger"] == "pdb":
        return [f"hpc-ddp: rank {rec['rank']} runs under pdb, in this terminal; {timeouts}"]
    return [f"hpc-ddp: rank {rec['rank']} waits for a debugger (debugpy) on {rec['listen']}; {timeouts}",
            f"hpc-ddp: from your laptop: {rec['tunnel']}  then attach VS Code or PyCharm to localhost:{rec['port']}",
            "hpc-ddp: note: it listens on loopback, so only this machine can attach" if rec["loopback"] else
            f"hpc-ddp: note: until a debugger attaches, anyone who can reach {rec['listen']} on the cluster's "
            "network can attach, and a debugger runs any code as you"]


def debugpy_missing(python: str) -> bool:
    """Can `python` not import debugpy? Asked in this process where it is this Python, else by running it
    (a Python this machine cannot run, e.g. only on the compute nodes, is left to the rank's own check)."""
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        return importlib.util.find_spec("debugpy") is None
    try:
        probe = subprocess.run([python, "-c", "import debugpy"], check=False, capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode != 0


def check_debugpy(python: str, where: str = "--debug-rank") -> None:
    if debugpy_missing(python):
        raise UserError(f"{where}: debugpy is not installed for {python}", hint=INSTALL_HINT)


def refuse_missing_debugpy(specs: Iterable[Any]) -> None:
    """At the submit edge (never on a dry run or render, which execute nothing): a debug rank's Python that
    cannot import debugpy is refused before anything is written. Each distinct Python is asked once, however
    many specs (a sweep's tasks) share it; one in a container is left to the rank (it is not runnable here)."""
    asked: set[str] = set()
    for spec in specs:
        if spec.debug_rank is None or spec.debugger != "debugpy" or spec.container is not None:
            continue
        key = os.path.realpath(spec.python)
        if key not in asked:
            asked.add(key)
            check_debugpy(spec.python, f"--debug-rank {spec.debug_rank}")


def _port(spec: Any, host: str) -> int:
    """The port it listens on: the one the user gave (taken: an error), else the first free from 5678."""
    if spec.debug_port is None:
        return first_free_port(DEFAULT_PORT) if host == _LOOPBACK else _first_free_on(host)
    if port_in_use(spec.debug_port, host):
        raise EnvError(f"--debug-port {spec.debug_port} is already in use on {socket.gethostname()}",
                       hint="choose another --debug-port, or leave it out to take the first free one from 5678")
    return spec.debug_port


def _first_free_on(host: str) -> int:
    return next((p for p in range(DEFAULT_PORT, DEFAULT_PORT + 50) if not port_in_use(p, host)), DEFAULT_PORT)


def wrap(spec: Any, rank: int, argv: list[str], env: Mapping[str, str], say=print) -> tuple[list[str], dict | None]:
    """On the debug rank: (the argv under the debugger, the event to record); elsewhere (argv, None)."""
    if spec.debug_rank is None or spec.debug_rank != rank:
        return argv, None
    if spec.debugger == "debugpy":
        check_debugpy(argv[0], f"--debug-rank {rank}")
    host, node = listen_host(env)
    port = _port(spec, host) if spec.debugger == "debugpy" else 0
    login = socket.gethostname() if env.get("HPC_DDP_LOCAL") else env.get("SLURM_SUBMIT_HOST") or "LOGIN_NODE"
    rec = record(rank, spec.debugger, host, node, port, login, spec.rendezvous_timeout, spec.collective_timeout)
    for line in log_lines(rec):
        say(line)
    return debug_argv(argv, spec.debugger, host, port), rec
