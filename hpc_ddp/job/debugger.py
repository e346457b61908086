"""A debugger on one chosen rank (`hpc-ddp submit --debug-rank R`): how its program is started, where an
IDE reaches it (the owner alone), what it prints, and how long the other ranks wait for it.

The runner calls `wrap` on every rank; only rank R changes: its program starts under debugpy (the protocol
VS Code and PyCharm speak) or, under the local executor with --pdb, under pdb with the terminal as its
stdin. The same process runs the program (no child), so the warning signal still reaches it and a Session
still checkpoints on it.

Who can attach: only the job's owner. debugpy has no authentication, and whoever speaks to it runs any code
as the job's user; on a shared node other users can reach 127.0.0.1 too. So the rank never listens: it
connects (`python -m debugpy --connect 127.0.0.1:P --wait-for-client`) to a relay that the runner started
first (job.debugrelay), which takes only a connection of the user's own UID and offers the IDE a Unix socket
(0600 in a 0700 directory) and, under the local executor, a loopback port whose peer is checked by UID.
- Local executor: attach the IDE to localhost:PORT here, or from a laptop through `ssh -N -L
  PORT:127.0.0.1:PORT HOST`.
- On a cluster: `hpc-ddp attach JOB` on the login node relays through `srun --jobid J --overlap` (which
  authenticates you) to the node's socket and serves a socket of yours there; from a laptop, `ssh -N -L
  PORT:THAT_SOCKET LOGIN`, then attach the IDE to localhost:PORT.
The rank's log and `hpc-ddp status` print those commands.

`wrap` starts the relay and `debugpy_missing` may run a Python; everything else is pure.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from hpc_ddp.common.errors import UserError
from hpc_ddp.job.debugrelay import FIRST_PORT, Ready, login_socket_path, node_socket_path, start

__all__ = ["DEBUGGERS", "DEBUG_TIMEOUT_S", "DEFAULT_PORT", "INSTALL_HINT", "check_debugpy", "debug_argv",
           "debugpy_missing", "log_lines", "record", "refuse_missing_debugpy", "stretched", "tunnel_command",
           "wrap"]

DEFAULT_PORT = FIRST_PORT     # debugpy's own default: what VS Code's "attach" configuration fills in
DEBUGGERS = ("debugpy", "pdb")
# While a rank may sit at a breakpoint the others wait in a collective (or at the rendezvous, for a rank
# that waits for its debugger before it starts): a day, rather than the minutes that catch a hung job.
DEBUG_TIMEOUT_S = 86400
INSTALL_HINT = "pip install 'hpc-ddp[debug]' (it installs debugpy) into the Python the ranks run"
_LOOPBACK = "127.0.0.1"


def stretched(timeout_s: int) -> int:
    """A timeout while a debugger may be attached: at least DEBUG_TIMEOUT_S, a longer one kept."""
    return max(timeout_s, DEBUG_TIMEOUT_S)


def tunnel_command(target: str, port: int, login: str) -> str:
    """What to run on a laptop so that its localhost:PORT reaches `target` on `login`: a HOST:PORT there, or
    the path of a Unix socket there (OpenSSH forwards a port to either)."""
    return f"ssh -N -L {port}:{target} {login}"


def debug_argv(argv: list[str], debugger: str, relay_port: int) -> list[str]:
    """The program's argv ([python, script | -m module, args...]) started under the debugger instead:
    debugpy connects to the relay at 127.0.0.1:relay_port (it never listens) and waits there for an IDE."""
    python, rest = argv[0], argv[1:]
    if debugger == "pdb":
        return [python, "-m", "pdb", *rest]
    # Frozen stdlib modules (3.11+) can make debugpy miss breakpoints (it warns in the log): off, as it advises.
    # No adapter process runs (pydevd speaks DAP itself), so child processes are not followed.
    return [python, "-Xfrozen_modules=off", "-m", "debugpy", "--connect", f"{_LOOPBACK}:{relay_port}",
            "--wait-for-client", "--configure-subProcess", "false", *rest]


def record(rank: int, debugger: str, rendezvous_timeout: int, collective_timeout: int, *, node: str = "",
           job_id: str = "", login: str = "", ready: Ready | None = None, python: str = "",
           slurm_job_id: str | None = None, laptop_port: int = DEFAULT_PORT, attach_as: str = "") -> dict[str, Any]:
    """The `debugger` event (events.jsonl) that `hpc-ddp status` shows: where the rank waits and the exact
    commands that reach it. `ready`: the relay's sockets; a local run has an IDE port, a cluster's not.
    `login`: the machine a laptop can ssh to (the submit host on a cluster; this machine under the local
    executor). `attach_as`: how `hpc-ddp attach` names the run (the job id where none is given)."""
    out: dict[str, Any] = {"event": "debugger", "rank": rank, "debugger": debugger,
                           "rendezvous_timeout": rendezvous_timeout, "collective_timeout": collective_timeout}
    if debugger != "debugpy" or ready is None:
        return out
    out.update(node=node, socket=ready.socket, python=python, owner_only=True, uid=os.getuid())
    if ready.ide_port is not None:  # the local executor: a loopback port here, the owner's alone
        port = ready.ide_port
        out.update(listen=f"{_LOOPBACK}:{port}", port=port, loopback=True,
                   tunnel=tunnel_command(f"{_LOOPBACK}:{port}", port, login), attach=None)
        return out
    at_login = login_socket_path(job_id, rank)
    out.update(listen=f"{node}:{ready.socket}", port=laptop_port, loopback=False, slurm_job_id=slurm_job_id,
               login_socket=at_login, attach=f"hpc-ddp attach {shlex.quote(attach_as or job_id)}",
               tunnel=tunnel_command(at_login, laptop_port, login))
    return out


def log_lines(rec: Mapping[str, Any]) -> list[str]:
    """What the rank prints in its log before it waits."""
    timeouts = (f"rendezvous and collective timeouts stretched to {rec['rendezvous_timeout']} s and "
                f"{rec['collective_timeout']} s while it may be stopped")
    if rec["debugger"] == "pdb":
        return [f"hpc-ddp: rank {rec['rank']} runs under pdb, in this terminal; {timeouts}"]
    if rec.get("loopback"):
        return [f"hpc-ddp: rank {rec['rank']} waits for a debugger (debugpy) on {rec['listen']}, which takes only "
                f"your own connections (uid {rec['uid']}); {timeouts}",
                f"hpc-ddp: attach VS Code or PyCharm to localhost:{rec['port']} on this machine; from your laptop: "
                f"{rec['tunnel']}  then attach to localhost:{rec['port']}"]
    return [f"hpc-ddp: rank {rec['rank']} waits for a debugger (debugpy) on {rec['node']}, reachable only by you "
            f"(uid {rec['uid']}) through srun; {timeouts}",
            f"hpc-ddp: on the login node run: {rec['attach']}  (leave it running: it relays to this rank)",
            f"hpc-ddp: then from your laptop: {rec['tunnel']}  and attach VS Code or PyCharm to "
            f"localhost:{rec['port']}"]


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


def wrap(spec: Any, rank: int, argv: list[str], env: Mapping[str, str], say=print,
         job_id: str = "") -> tuple[list[str], dict | None]:
    """On the debug rank: (the argv under the debugger, the event to record), after starting the relay its
    debugpy connects to; elsewhere (argv, None)."""
    if spec.debug_rank is None or spec.debug_rank != rank:
        return argv, None
    if spec.debugger != "debugpy":
        rec = record(rank, spec.debugger, spec.rendezvous_timeout, spec.collective_timeout)
        for line in log_lines(rec):
            say(line)
        return debug_argv(argv, spec.debugger, 0), rec
    check_debugpy(argv[0], f"--debug-rank {rank}")
    local = bool(env.get("HPC_DDP_LOCAL"))
    job_id = job_id or env.get("SLURM_JOB_ID") or "local"
    ready = start(node_socket_path(job_id, rank), spec.debug_port, local)
    login = socket.gethostname() if local else env.get("SLURM_SUBMIT_HOST") or "LOGIN_NODE"
    rec = record(rank, spec.debugger, spec.rendezvous_timeout, spec.collective_timeout,
                 node=env.get("SLURMD_NODENAME") or socket.gethostname(), job_id=job_id, login=login, ready=ready,
                 python=sys.executable, slurm_job_id=None if local else env.get("SLURM_JOB_ID"),
                 laptop_port=spec.debug_port or DEFAULT_PORT, attach_as=_attach_as(job_id, env))
    for line in log_lines(rec):
        say(line)
    return debug_argv(argv, spec.debugger, ready.rank_port), rec


def _attach_as(job_id: str, env: Mapping[str, str]) -> str:
    """The run as `hpc-ddp attach` is told it: its job id, where that is the id the registry knows (a plain
    Slurm job), else its run dir (a sweep's task is registered by its array id)."""
    if job_id.isdigit() and not env.get("SLURM_ARRAY_JOB_ID"):
        return job_id
    return env.get("HPC_DDP_RUN_DIR") or job_id
