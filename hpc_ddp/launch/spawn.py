"""The ranks of a Python call as processes on this machine (`hpc_ddp.notebook.launch`): their environment,
then `watch` until every one has ended.

Each rank is a fresh interpreter (`python -m hpc_ddp.job.calls CALL_DIR`) under a supervisor, in a session of
its own (`procs.Supervised`): it is signalled with its DataLoader workers as one group, what it starts ends
when it does (a process that left its group too), and all of it stops when the launcher dies. `watch` echoes
the ranks' output, prefixed by rank; after the first rank fails the others get `grace` seconds to fail or
finish on their own (a peer in a collective usually fails at once), then they are killed; at `timeout` every
rank still running is killed. Whatever ends the watch, an exception or Ctrl-C in the notebook included, no
rank, nor any process a rank started, outlives it: its `finally` sends SIGTERM to every rank's group, then
SIGKILL to all they started, and reaps every rank.

`rank_env` is pure: the same variables hpc-ddp's per-rank runner gives every rank (`job.runner.rank_environment`)
for one simulated node on 127.0.0.1.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import IO

from hpc_ddp.common.procs import Supervised
from hpc_ddp.job.distenv import DistEnv
from hpc_ddp.job.runner import rank_environment
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["rank_env", "start_ranks", "watch", "Ended", "FAILURE_GRACE_S", "TERM_GRACE_S"]

FAILURE_GRACE_S = 5.0   # after one rank fails, the others may still fail or finish on their own this long
TERM_GRACE_S = 3.0      # between SIGTERM and SIGKILL when ranks are ended
TAIL_LINES = 20         # of each rank's output, kept for an error that has no traceback to show


def rank_env(spec: JobSpec, rank: int, port: int, run_dir: str, job_id: str, base: Mapping[str, str], *,
             nvidia_driver: bool) -> dict[str, str]:
    """Rank `rank`'s whole environment: `base` (the launcher's) with hpc-ddp's rank variables over it. Without
    GPUs the ranks see none (gloo on the CPU, even where the launcher's process uses CUDA)."""
    env = dict(base)
    if not spec.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif not env.get("CUDA_VISIBLE_DEVICES"):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(spec.gpus))
    if env.get("MPLBACKEND", "").startswith("module://"):  # the notebook's inline backend needs a kernel
        env["MPLBACKEND"] = "Agg"
    n = spec.tasks_per_node
    dist = DistEnv(rank=rank, local_rank=rank, world_size=n, local_world_size=n, node_rank=0, num_nodes=1,
                   master_addr="127.0.0.1", master_port=port, hosts=("localhost",), job_id=job_id,
                   restart_count=0, source="notebook")
    env.update(rank_environment(spec, dist, env, run_dir, nvidia_driver=nvidia_driver))
    return env


def start_ranks(argv: Sequence[str], envs: Sequence[Mapping[str, str]], cwd: str) -> list[Supervised]:
    procs: list[Supervised] = []
    try:
        for env in envs:
            procs.append(Supervised(list(argv), grace=TERM_GRACE_S, env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    except BaseException:
        end_all(procs)  # a rank that failed to start: the ones already started must not linger
        raise
    return procs


@dataclasses.dataclass
class Ended:
    """How the ranks ended: exit codes (negative: killed by that signal), who failed first, who we killed."""

    codes: list[int]
    first_failed: int | None = None
    killed: list[int] = dataclasses.field(default_factory=list)
    timed_out: bool = False
    tails: dict[int, list[str]] = dataclasses.field(default_factory=dict)


def watch(procs: list[Supervised], *, timeout: float | None = None, grace: float = FAILURE_GRACE_S,
          echo: bool = True, out: IO[str] | None = None, err: IO[str] | None = None) -> Ended:
    output = _Output(procs, echo, out or sys.stdout, err or sys.stderr)
    start, failed_at, ended = time.monotonic(), None, Ended(codes=[])
    try:
        while True:
            output.read(0.1)
            now, codes = time.monotonic(), [p.poll() for p in procs]
            if ended.first_failed is None:
                ended.first_failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
                failed_at = now if ended.first_failed is not None else None
            live = [r for r, c in enumerate(codes) if c is None]
            if not live:
                output.read(1.0, until_closed=True)  # what the ranks printed last
                break
            if failed_at is not None and now - failed_at > grace:
                ended.killed = live
                break
            if timeout is not None and now - start > timeout:
                ended.killed, ended.timed_out = live, True
                break
    finally:
        end_all(procs)
        output.close()
    ended.codes = [p.returncode for p in procs]
    ended.tails = output.tails()
    return ended


def end_all(procs: Sequence[Supervised]) -> None:
    """SIGTERM to every rank still running (its whole group), SIGKILL to all that those alive TERM_GRACE_S
    later started, then reap them all. Only live ranks are signalled: a reaped rank's pid may belong to
    someone else. A rank that has ended has no process left: its supervisor ended them before it exited."""
    for p in procs:
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        p.kill_group()
    for p in procs:
        p.wait()


class _Output:
    """Every rank's stdout and stderr, read in this thread (a notebook shows what its own cell's thread
    prints), cut into lines, echoed with a `[rank N] ` prefix, and the last lines of each kept."""

    def __init__(self, procs: Sequence[Supervised], echo: bool, out: IO[str], err: IO[str]):
        self.selector = selectors.DefaultSelector()
        self.partial: dict[tuple[int, int], bytes] = {}
        self.tail = {rank: collections.deque(maxlen=TAIL_LINES) for rank in range(len(procs))}
        self.echo, self.streams = echo, {1: out, 2: err}
        self.pipes = [pipe for p in procs for pipe in (p.stdout, p.stderr)]
        for rank, p in enumerate(procs):
            for which, pipe in ((1, p.stdout), (2, p.stderr)):
                os.set_blocking(pipe.fileno(), False)
                self.selector.register(pipe, selectors.EVENT_READ, (rank, which))

    def read(self, wait: float, until_closed: bool = False) -> None:
        """Read what is there (waiting up to `wait` s for something); with until_closed, go on until every
        pipe is closed or `wait` has passed (a grandchild may hold a pipe open for ever)."""
        deadline = time.monotonic() + wait
        while self.selector.get_map():
            left = deadline - time.monotonic()
            ready = self.selector.select(max(left, 0))
            for key, _ in ready:
                self._take(key)
            if not until_closed or left <= 0:
                return

    def _take(self, key: selectors.SelectorKey) -> None:
        rank, which = key.data
        try:
            data = os.read(key.fd, 65536)
        except BlockingIOError:
            return
        if not data:
            self.selector.unregister(key.fileobj)
            data = b"\n" if self.partial.get((rank, which)) else b""
        *lines, rest = (self.partial.pop((rank, which), b"") + data).split(b"\n")
        if rest:
            self.partial[(rank, which)] = rest
        for line in lines:
            text = line.decode("utf-8", "replace")
            self.tail[rank].append(text)
            if self.echo:
                self.streams[which].write(f"[rank {rank}] {text}\n")
        if lines and self.echo:
            self.streams[which].flush()

    def tails(self) -> dict[int, list[str]]:
        return {rank: list(lines) for rank, lines in self.tail.items()}

    def close(self) -> None:
        self.selector.close()
        for pipe in self.pipes:
            pipe.close()
