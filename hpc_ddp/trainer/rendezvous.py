"""Rendezvous that fails fast and names who is missing: the trainer's own join, health check,
heartbeat and exit, around torch.distributed.

torch's env:// rendezvous waits up to 30 minutes for a rank that never started and then says only
that it timed out. Here rank 0 hosts a TCPStore on MASTER_PORT (a taken port fails at once, naming
it); every rank registers under its rank number and host, and all wait for the others with a bounded
`rendezvous_timeout`, after which each names the ranks that did not join and where they were expected.
The process group is then built on that store, and one small all-reduce (the health check) must
complete on every rank before training starts. During training each rank bumps a heartbeat counter in
the store, so when a collective fails, the survivors can say which rank stopped responding.
A SIGTERM (or `stop()`) while the ranks are meeting ends the wait at once: nothing is trained yet, so
there is nothing to save, and waiting out the rendezvous timeout would only delay the job's end.
`Expected hosts` follow Slurm's block distribution: rank r runs on node r // tasks_per_node.

At scale (bench/README.md, "Scale", measures it at 2,048 ranks) every rank talks to one store server, so
no rank does O(world) requests where one rank can do them for all: a waiting rank polls one counter,
backing off so that all of them together poll about STORE_POLLS_PER_S times per second; when ranks are
missing (join, health check, a collective barrier) or a peer is lost, the first rank to claim the
question works out the answer once and publishes it, and the others read it. Steady state costs one
heartbeat per rank every HEARTBEAT_S. Rank 0's process holds two connections per rank (each rank's store
and its heartbeat's): it raises its own open-file limit to fit them before it listens, or says at once that
the hard limit cannot (at 256 nodes x 8 ranks that is 4,096 sockets; Linux's default soft limit is 1,024).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from hpc_ddp.common.errors import HpcDdpError
from hpc_ddp.job.distenv import DistEnv
from hpc_ddp.job.ports import PORT_HINT, taken_port_message

__all__ = [
    "Heartbeat",
    "PeerLost",
    "RendezvousError",
    "RendezvousStopped",
    "describe_ranks",
    "expected_host",
    "explain_failure",
    "health_check",
    "join",
    "leave",
    "mark_left",
    "poll_delays",
    "unresponsive",
    "wait_for_all",
]

HEARTBEAT_S = 2.0
STORE_POLLS_PER_S = 5000  # all waiting ranks together, once backed off; one libuv store serves ~100k/s
FIRST_POLL_S = 0.05       # ranks that arrive together (a checkpoint barrier) go on at once
MAX_POLL_S = 2.0
CONNECTIONS_PER_RANK = 2  # each rank's store client and its Heartbeat's, open for the whole run
FD_MARGIN = 256           # rank 0's own files beside them: libraries, logs, a checkpoint being written
LEFT_AFTER_OTHERS = "left after another rank's failure"  # a `left/<rank>` reason that blames nobody


class RendezvousError(HpcDdpError):
    """The ranks could not all meet (exit 1: not the user's input, but nothing to requeue either)."""


class RendezvousStopped(RendezvousError):
    """A stop signal came while the ranks were meeting. Exit 128 + SIGTERM, as if the signal had ended
    the process: not a requeue (no step was trained, nothing was saved)."""

    exit_code = 128 + signal.SIGTERM


class PeerLost(HpcDdpError):
    """A rank stopped responding during training."""


def expected_host(env: DistEnv, rank: int) -> str:
    node = rank // max(env.local_world_size, 1)
    return env.hosts[node] if node < len(env.hosts) else f"node {node}"


def describe_ranks(env: DistEnv, ranks: list[int], limit: int = 8) -> str:
    """"rank 3 (hpcn2)" / "ranks 2 (hpcn2), 3 (hpcn2)", the first `limit` of them."""
    shown = ", ".join(f"{r} ({expected_host(env, r)})" for r in ranks[:limit])
    more = f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


def _wait_for_server(addr: str, port: int, deadline: float, check: Callable[[], None] = lambda: None) -> None:
    # Our own probe, so the timeout is the one configured (TCPStore's client retries for ~2.5x it).
    while True:
        check()
        try:
            socket.create_connection((addr, port), timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _scoped(store: dist.Store, env: DistEnv) -> dist.PrefixStore:
    # Under torchrun the store is its agent's and outlives a restart: keep each attempt's keys apart.
    return dist.PrefixStore(f"hpc-ddp/{env.job_id}/{env.restart_count}", store)


def _store(env: DistEnv, timeout_s: float, host: str, check: Callable[[], None] = lambda: None) -> dist.TCPStore:
    """Rank 0 listens; the others connect (waiting at most `timeout_s` for rank 0 to come up)."""
    timeout = timedelta(seconds=timeout_s)
    # Under torchrun its agent already serves a store on MASTER_PORT: every rank is a client of it.
    if env.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        _room_for_connections(env, host)
        try:
            return dist.TCPStore(env.master_addr, env.master_port, env.world_size, True, timeout,
                                 wait_for_workers=False)
        except dist.DistNetworkError as exc:
            if "EADDRINUSE" in str(exc) or "in use" in str(exc):
                raise RendezvousError(taken_port_message(env.master_port, host), hint=PORT_HINT) from None
            raise RendezvousError(f"rank 0 on {host} cannot listen on MASTER_PORT {env.master_port}: {exc}",
                                  hint=PORT_HINT) from None
    try:
        _wait_for_server(env.master_addr, env.master_port, time.monotonic() + timeout_s, check)
        return dist.TCPStore(env.master_addr, env.master_port, env.world_size, False, timeout)
    except (OSError, dist.DistError) as exc:
        raise RendezvousError(
            f"rank {env.rank} on {host} could not reach rank 0's rendezvous at {env.master_addr}:{env.master_port} "
            f"within {timeout_s:g} s ({exc}): rank 0 ({expected_host(env, 0)}) did not start, died, or is unreachable",
            hint="see rank 0's log (hpc-ddp logs JOB --rank 0); raise rendezvous_timeout if nodes start "
                 "slowly") from None


def _room_for_connections(env: DistEnv, host: str) -> None:
    """Raise this process's soft limit on open files so rank 0's store can accept every rank's connections.
    Past the limit the server cannot accept, and the ranks it leaves out time out blaming rank 0; a hard
    limit that cannot hold the connections alone is said here instead, once, with the fix."""
    connections = CONNECTIONS_PER_RANK * env.world_size
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= connections + FD_MARGIN:
        return
    if hard != resource.RLIM_INFINITY and hard <= connections:
        raise RendezvousError(
            f"rank 0 on {host} may open at most {hard} files (hard limit), and its rendezvous store needs "
            f"{connections} connections for {env.world_size} ranks ({CONNECTIONS_PER_RANK} each) and its own files",
            hint="ask the cluster's admins to raise the open-files limit (nofile) on the compute nodes, or run "
                 "fewer ranks")
    wanted = connections + FD_MARGIN if hard == resource.RLIM_INFINITY else min(connections + FD_MARGIN, hard)
    with contextlib.suppress(ValueError, OSError):  # not allowed here: the store still serves what fits
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def poll_delays(world_size: int) -> Iterator[float]:
    """Seconds between a waiting rank's polls of the store: FIRST_POLL_S, then 1.5 times longer each
    time up to world_size / STORE_POLLS_PER_S (at least FIRST_POLL_S, at most MAX_POLL_S). Up to 250
    ranks nothing backs off; at 2,048 the cap is 0.4 s."""
    cap = min(MAX_POLL_S, max(FIRST_POLL_S, world_size / STORE_POLLS_PER_S))
    delay = FIRST_POLL_S
    while True:
        yield delay
        delay = min(delay * 1.5, cap)


def _missing(store: dist.Store, env: DistEnv, prefix: str) -> list[int]:
    """The ranks without `prefix/<rank>`, found by halving: one check of a block of keys says whether all
    of them are there, so m missing ranks cost about 2 m log2(world / m) requests, not one per rank."""
    out: list[int] = []

    def look(lo: int, hi: int) -> None:
        if store.check([f"{prefix}/{r}" for r in range(lo, hi)]):
            return
        if hi - lo == 1:
            out.append(lo)
            return
        mid = (lo + hi) // 2
        look(lo, mid)
        look(mid, hi)

    if env.world_size:
        look(0, env.world_size)
    return out


def _missing_once(store: dist.Store, env: DistEnv, prefix: str) -> list[int]:
    """The ranks that have not set `prefix/<rank>`, worked out by one rank for all: the ranks that wait
    time out together, and each asking the store about every rank is O(world^2) requests. Keyed by the
    arrival count, so a rank that asks after more have come does not get an old answer."""
    count = int(store.add(f"{prefix}/count", 0))
    if count >= env.world_size:
        return []
    key = f"{prefix}/missing/{count}"
    if int(store.add(f"{key}/claim", 1)) == 1:
        missing = _missing(store, env, prefix)
        store.set(key, ",".join(map(str, missing)))
        return missing
    answer = _await(store, key, env, _answer_grace_s(env))
    if answer is None:  # the rank that claimed it is gone: ask for ourselves
        return _missing(store, env, prefix)
    return [int(r) for r in answer.split(",") if r]


def _answer_grace_s(env: DistEnv) -> float:
    """How long to wait for another rank's answer: its O(world) requests, and a margin."""
    return 10.0 + env.world_size / 1000


def _await(store: dist.Store, key: str, env: DistEnv, limit_s: float) -> str | None:
    """The value of `key` once some rank has set it, or None after `limit_s`."""
    deadline = time.monotonic() + limit_s
    for delay in poll_delays(env.world_size):
        if store.check([key]):
            return store.get(key).decode(errors="replace")
        if time.monotonic() > deadline:
            return None
        time.sleep(delay)
    return None  # pragma: no cover - poll_delays never ends


def _wait_all(store: dist.Store, env: DistEnv, prefix: str, deadline: float,
              check: Callable[[], None] = lambda: None) -> list[int]:
    """Wait until every rank has set `prefix/<rank>`; the ranks still missing at the deadline."""
    try:
        for delay in poll_delays(env.world_size):
            check()
            if int(store.add(f"{prefix}/count", 0)) >= env.world_size:
                return []
            if time.monotonic() >= deadline:
                break
            time.sleep(min(delay, max(deadline - time.monotonic(), 0.0)))
        return _missing_once(store, env, prefix)
    except dist.DistError:
        raise RendezvousError(f"rank {env.rank}: {_store_gone(env)} while the ranks were meeting: it gave up or "
                              "died first", hint="its log says why (hpc-ddp logs JOB --rank 0)") from None


def _store_gone(env: DistEnv) -> str:
    return (f"rank 0 ({expected_host(env, 0)}) is gone: its rendezvous store at {env.master_addr}:"
            f"{env.master_port} stopped answering")


def join(env: DistEnv, *, timeout_s: float, host: str | None = None,
         stop: Callable[[], bool] | None = None) -> dist.Store:
    """Meet every other rank within `timeout_s`, or raise naming the ranks that did not come; raise
    RendezvousStopped at once on SIGTERM or when `stop()` says so. Rank 0's store server lives as long
    as the returned store: keep it."""
    host = host or socket.gethostname()
    started = time.monotonic()
    with _stoppable(env, host, stop) as check:
        store = _scoped(_store(env, timeout_s, host, check), env)
        store.set(f"joined/{env.rank}", host)
        store.add("joined/count", 1)
        missing = _wait_all(store, env, "joined", started + timeout_s, check)
    if missing:
        raise RendezvousError(
            f"{describe_ranks(env, missing)} did not join the rendezvous within {timeout_s:g} s "
            f"({env.world_size - len(missing)} of {env.world_size} ranks did)",
            hint="see those ranks' logs (hpc-ddp logs JOB --rank N): they did not start, crashed or hung "
                 "before training; raise rendezvous_timeout if staging or start-up is slow")
    return store


@contextlib.contextmanager
def _stoppable(env: DistEnv, host: str, stop: Callable[[], bool] | None) -> Iterator[Callable[[], None]]:
    """A `check()` for the wait loops that raises RendezvousStopped once SIGTERM arrived (or `stop()`).
    The handler already installed (the trainer's stop flag) still gets the signal; with none of
    Python's (the default action), the signal ends the process by itself and nothing is wrapped."""
    got: list[int] = []
    previous = signal.getsignal(signal.SIGTERM)
    wrap = callable(previous) and threading.current_thread() is threading.main_thread()
    if wrap:
        def on_term(signum, frame):
            got.append(signum)
            previous(signum, frame)
        signal.signal(signal.SIGTERM, on_term)

    def check() -> None:
        if got or (stop is not None and stop()):
            why = "SIGTERM" if got else "a stop request"
            raise RendezvousStopped(f"rank {env.rank} on {host}: stopped by {why} while the ranks were meeting; "
                                    "no step was trained, so there is nothing to save")
    try:
        yield check
    finally:
        if wrap and signal.getsignal(signal.SIGTERM) is on_term:
            signal.signal(signal.SIGTERM, previous)


def health_check(store: dist.Store, env: DistEnv, device: torch.device, timeout_s: float,
                 connect: Callable[[], None] = lambda: None) -> None:
    """`connect()` (building the process group: gloo connects every pair of ranks there) and one small
    all-reduce over the real backend and device must finish within `timeout_s`."""
    store.set(f"health/{env.rank}", "entered")
    store.add("health/count", 1)
    done = threading.Event()
    threading.Thread(target=_health_watchdog, args=(store, env, timeout_s, done), daemon=True).start()
    connect()
    ones = torch.ones(1, device=device)
    dist.all_reduce(ones)
    total = int(ones.item())
    done.set()
    if total != env.world_size:
        raise RendezvousError(f"health check: an all-reduce of ones over {env.world_size} ranks gave {total}",
                              hint="the communication backend is broken on some node; try BACKEND=gloo to compare")


def _health_watchdog(store: dist.Store, env: DistEnv, timeout_s: float, done: threading.Event) -> None:
    # The all-reduce itself may block far longer (the collective timeout): say why, and leave.
    if done.wait(timeout_s):
        return
    why = "every rank got that far, so the ranks cannot reach each other"
    with contextlib.suppress(Exception):  # the store may be gone too; still leave
        absent = _missing_once(store, env, "health")
        if absent:
            why = f"{describe_ranks(env, absent)} never reached it"
    print(f"hpc-ddp: error: health check: connecting the ranks and a first all-reduce did not complete within "
          f"{timeout_s:g} s: {why}\n"
          "HINT: check those ranks' logs and the network between the nodes (NCCL_SOCKET_IFNAME / "
          "GLOO_SOCKET_IFNAME)", file=sys.stderr, flush=True)
    os._exit(1)


class Heartbeat:
    """A daemon thread that bumps `heartbeat/<rank>` every HEARTBEAT_S over its own store connection."""

    def __init__(self, env: DistEnv, interval_s: float = HEARTBEAT_S,
                 on_failed_peer: Callable[[int, str, dist.Store], None] | None = None):
        self.env, self.interval_s, self.on_failed_peer = env, interval_s, on_failed_peer
        self._stop = threading.Event()
        self._store = _scoped(dist.TCPStore(env.master_addr, env.master_port, env.world_size, False,
                                            timedelta(seconds=30)), env)
        self._thread = threading.Thread(target=self._beat, name="hpc-ddp-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._store.add(f"heartbeat/{self.env.rank}", 1)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(f"heartbeat/{self.env.rank}", 1)
                failed = self._failed_peer() if self.on_failed_peer is not None else None
            except Exception:  # noqa: BLE001 - rank 0 (the store) is gone; the collectives will say so
                return
            if failed is not None:
                self.on_failed_peer(*failed, self._store)
                return

    def _failed_peer(self) -> tuple[int, str] | None:
        """Another rank that left for a failure of its own (not finished, not after another's failure)."""
        for rank, why in left_ranks(self._store).items():
            if rank != self.env.rank and why not in ("finished", LEFT_AFTER_OTHERS):
                return rank, why
        return None

    def stop(self) -> None:
        self._stop.set()


def mark_left(store: dist.Store | None, env: DistEnv, why: str) -> None:
    """Say in the store that this rank is leaving, and why, before its heartbeat stops: the others must
    not take a rank that failed for its own reason, or finished, for one that hung."""
    if store is not None:
        with contextlib.suppress(Exception):  # the store may already be gone
            store.set(f"left/{env.rank}", why[:300])
            store.append("left/ranks", f"{env.rank},")  # after the reason: a rank listed has one


def unresponsive(store: dist.Store, env: DistEnv, window_s: float = 2.5 * HEARTBEAT_S) -> list[int]:
    """Ranks whose heartbeat did not move during `window_s` and that did not say they left.
    Raises DistError if the store is gone."""
    keys = [f"heartbeat/{r}" for r in range(env.world_size)]
    before = _counters(store, keys)
    time.sleep(window_s)
    after = _counters(store, keys)
    return [r for r in range(env.world_size)
            if after[r] == before[r] and r != env.rank and not store.check([f"left/{r}"])]


def _counters(store: dist.Store, keys: list[str]) -> list[int]:
    """The counters at `keys`: two requests when all exist (every rank beat once at start-up), else one
    per key (a missing one reads, and is created, as 0)."""
    if store.check(keys):
        return [int(v) for v in store.multi_get(keys)]
    return [int(store.add(k, 0)) for k in keys]


def _failed_ranks(store: dist.Store, env: DistEnv) -> list[str]:
    """"rank R (host) failed: why" for each other rank that left for a reason of its own: the ranks
    that left are listed in one key, so this reads O(ranks that left), not O(world)."""
    if not store.check(["left/ranks"]):
        return []
    listed = store.get("left/ranks").decode(errors="replace").split(",")
    out = []
    for r in sorted({int(x) for x in listed if x.strip().isdigit()} - {env.rank}):
        why = store.get(f"left/{r}").decode(errors="replace")
        if why not in ("finished", LEFT_AFTER_OTHERS):
            out.append(f"rank {r} ({expected_host(env, r)}) failed: {why}")
    return out


def explain_failure(store: dist.Store | None, env: DistEnv, window_s: float = 2.5 * HEARTBEAT_S) -> str | None:
    """After a failed collective: which peer failed or is gone, as one line, or None if every other rank
    is alive and well. The first rank to find out records its verdict; later ones repeat it rather than
    blame ranks that have since left after finding out themselves.

    When a peer dies every survivor asks at about the same time, and each looking at every rank's
    heartbeat would be O(world^2) requests. So the ranks take turns in rounds: the first to claim a round
    investigates (once) and publishes its answer; the ranks that asked during that
    round take it. An investigation that blames nobody closes its round, so a rank that fails later
    (say, because the investigator has since left for its own reasons) investigates afresh. The
    investigation itself reads every heartbeat in one request and the ranks that left from one key."""
    if store is None:
        return None
    try:
        if store.check(["verdict"]):
            return store.get("verdict").decode()
        round_ = int(store.add("verdict/round", 0))
        if int(store.add(f"verdict/{round_}/claim", 1)) == 1:
            return _investigate(store, env, window_s, round_)
        answer = _await(store, f"verdict/{round_}/done", env, window_s + _answer_grace_s(env))
        return answer or None  # "": nobody to blame; None: the investigator is gone before it said
    except Exception:  # noqa: BLE001 - the store lives in rank 0's process: it is the one that went
        return _store_gone(env)


def _investigate(store: dist.Store, env: DistEnv, window_s: float, round_: int) -> str | None:
    line = None
    try:
        # A rank that said why it failed is the cause, named at once; only when none did is the heartbeat
        # window waited (a killed rank says nothing). That window held every survivor of a crash up by
        # 2.5 heartbeats, before its restart could begin (issue 44).
        parts = _failed_ranks(store, env)
        lost = [] if parts else unresponsive(store, env, window_s)
        if lost:
            parts.append(f"{describe_ranks(env, lost)} stopped responding (no heartbeat for {window_s:g} s): "
                         f"{'they' if len(lost) > 1 else 'it'} died or hung")
        line = "; ".join(parts) or None
        if line and int(store.add("verdict/claim", 1)) == 1:
            store.set("verdict", line)
        return line
    finally:
        with contextlib.suppress(Exception):  # the store is gone: the waiting ranks will find out themselves
            store.add("verdict/round", 1)  # first: a rank that asks from now on starts a round of its own
            store.set(f"verdict/{round_}/done", line or "")


def leave(timeout_s: float = 10.0) -> None:
    """Destroy the process group, but never wait more than `timeout_s`: with peers gone, destroying
    can block, and a rank stuck here keeps the whole allocation alive."""
    if not dist.is_initialized():
        return
    worker = threading.Thread(target=dist.destroy_process_group, daemon=True)
    worker.start()
    worker.join(timeout_s)


def outlive_peers(store: dist.Store | None, env: DistEnv, timeout_s: float,
                  quiet_s: float = 1.5 * HEARTBEAT_S) -> None:
    """Rank 0 holds the store: keep it up until every other rank has said it left (or `timeout_s`), so a
    peer that finds out about a failure reads its reason there, says one line and leaves, instead of
    finding the store gone and printing c10d's C++ frame dumps (issue 43).

    A rank that has not said it left and whose heartbeat has not moved for `quiet_s` is not waited for:
    it was killed, or its node was lost, and nobody is left there to read the store. Waiting the whole
    bound for it held every crash's restart up by 5 s (15 s after an error), and Slurm's kill of the step
    (KillWait, 30 s on many clusters) was all that ended it (issue 44)."""
    if store is None or env.rank != 0 or env.world_size < 2:
        return
    start = time.monotonic()
    deadline = start + timeout_s
    keys = [f"heartbeat/{r}" for r in range(env.world_size)]
    with contextlib.suppress(Exception):
        seen = _counters(store, keys)
        moved = [start] * env.world_size
        while time.monotonic() < deadline:
            left = left_ranks(store)
            if len(left) >= env.world_size:
                return
            now, counts = time.monotonic(), _counters(store, keys)
            moved = [now if a != b else t for a, b, t in zip(seen, counts, moved)]
            seen = counts
            if all(r == env.rank or r in left or now - moved[r] >= quiet_s for r in range(env.world_size)):
                return
            time.sleep(0.1)


def wait_for_all(store: dist.Store, env: DistEnv, name: str, timeout_s: float,
                 check: Callable[[], None] = lambda: None) -> list[int]:
    """Mark this rank as arrived at `name` and wait until every rank has; the ranks still missing after
    `timeout_s` (empty when all came). For calls that must be collective (a checkpoint save), so a rank
    that never comes is named instead of hanging a collective until its timeout. `check` runs at each
    poll and may raise (a rank that went elsewhere, or left)."""
    store.set(f"{name}/{env.rank}", "1")
    store.add(f"{name}/count", 1)
    return _wait_all(store, env, name, time.monotonic() + timeout_s, check)


def left_ranks(store: dist.Store) -> dict[int, str]:
    """The ranks that said they left (mark_left), with their reasons. Raises DistError if the store is gone."""
    if not store.check(["left/ranks"]):
        return {}
    ranks = sorted({int(r) for r in store.get("left/ranks").decode().split(",") if r.strip().isdigit()})
    return {r: store.get(f"left/{r}").decode(errors="replace") for r in ranks}
