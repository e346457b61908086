"""The trainer's rendezvous at `nodes` x `per_node` ranks (threads) against one real TCPStore, hosted by
rank 0 as in a job: `hpc_ddp.trainer.rendezvous` join, health check, heartbeats, and the failure paths
(a rank that stops beating mid-training, one missing at the health check, one missing at a barrier).

What is measured (store requests are counted per call: see storecount):

- join: ranks arrive over `spread` seconds; one straggler comes `hold` seconds after the rest. Requests/s
  while the others wait (last `window` s of the hold), measured and asked (at the intervals the code
  sleeps for, as in sim_stage), and time to all-ready (the straggler's first request to the last return).
- health: the bookkeeping of `health_check` (the all-reduce itself is a stub that returns the world size:
  2,048 process groups cannot share one process), requests per rank.
- heartbeats: every rank's `Heartbeat` at the real HEARTBEAT_S for `beat_s` seconds: requests/s.
- failures: requests and seconds until every caller has its answer, when one rank stops beating
  (`explain_failure` on every survivor, with its real 5 s window over the real 2 s heartbeats), misses
  the health check, or misses a collective barrier (timeouts `fail_timeout`).
  With `callers` set, only that many survivors call (the others are not simulated) and the totals are
  per caller x survivors: for code whose every survivor does O(world) requests, which 2 cores cannot run
  at 2,048 ranks in reasonable time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from bench.scale import sleeps, slurmenv, storecount

__all__ = ["run"]

# --quick: every path runs, with heartbeats 4x the code's rate and the windows cut to match.
QUICK = {"spread": 0.2, "hold": 1.0, "window": 0.5, "beat_s": 1.0, "fail_timeout": 0.5, "interval": 0.5}


def _threads(world: int, target, name: str = "rank") -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(r,), name=f"{name}-{r}", daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    return threads


def _join_all(threads: list[threading.Thread], timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(end - time.monotonic(), 0.1))


def _say(what: str, since: float) -> None:
    print(f"[sim_rendezvous] {what}: {time.monotonic() - since:.1f} s", file=sys.__stderr__, flush=True)


def _window_rates(requests, slept, before, after, t0, t1, waiting: set[str]) -> tuple[float, float]:
    """(measured, asked) requests/s over a window; asked counts the waiting threads' requests over the
    seconds they asked to sleep, times how many they are."""
    (_k0, th0), (_k1, th1), s0, s1 = before[0], after[0], before[1], after[1]
    done = sum(n for who, n in (th1 - th0).items() if who in waiting)
    total = sum((_k1 - _k0).values())
    asked_sleep = sum(s for who, s in (s1 - s0).items() if who in waiting)
    asked = len(waiting) * done / asked_sleep if asked_sleep else 0.0
    return total / (t1 - t0), asked


def _join(rdv, envs, hosts, requests, *, spread, hold, window, seed):
    world = len(envs)
    rng = random.Random(seed)
    starts = [rng.uniform(0, spread) for _ in range(world)]
    straggler = world // 2 + 1
    stores: list = [None] * world
    returned: list[float | None] = [None] * world
    arrived = threading.Event()
    errors: list[str] = []

    def rank(r: int) -> None:
        try:
            if r == straggler:
                arrived.wait()
            else:
                sleeps.real_sleep(starts[r])
            stores[r] = rdv.join(envs[r], timeout_s=600, host=hosts[r])
            returned[r] = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"rank {r}: {type(exc).__name__}: {exc}")

    with sleeps.recording() as slept:
        started = time.monotonic()
        threads = _threads(world, rank)
        # On the development VM about one TCPStore client connect in 27 takes 5 s (c10d's connect(2) there;
        # plain sockets do not): wait until every rank but the straggler has joined and is waiting.
        while requests.snapshot()[0]["set"] < world - 1:
            time.sleep(0.1)
        time.sleep(max(hold - window, 0.5))
        before = (requests.snapshot(), slept.snapshot())
        t0 = time.monotonic()
        time.sleep(window)
        after = (requests.snapshot(), slept.snapshot())
        t1 = time.monotonic()
        arrived.set()
        _join_all(threads)
    if errors or None in returned:
        raise RuntimeError(f"join: {len(errors)} ranks failed, first: {errors[:1]}")
    waiting = {f"rank-{r}" for r in range(world) if r != straggler}
    measured, asked = _window_rates(requests, slept, before, after, t0, t1, waiting)
    return stores, {
        "ranks_ready": sum(t is not None for t in returned),
        # From the straggler's first request (its store connect is the VM's, see above) to the last return.
        "time_to_all_ready_s": round(max(returned) - requests.first_at[(f"rank-{straggler}", "set")], 3),
        "wall_s": round(time.monotonic() - started, 2),
        "requests_per_s_measured": round(measured, 1), "requests_per_s_asked": round(asked, 1),
    }


def _health(rdv, stores, envs):
    world = len(envs)
    errors: list[str] = []

    def rank(r: int) -> None:
        try:
            rdv.health_check(stores[r], envs[r], torch.device("cpu"), timeout_s=120)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"rank {r}: {exc}")

    _join_all(_threads(world, rank))
    if errors:
        raise RuntimeError(f"health: {errors[:1]}")


def _started_heartbeats(rdv, envs, interval: float) -> list:
    """Every rank's Heartbeat, built at once: each connects to the store (see the note in _join)."""
    beats: list = [None] * len(envs)

    def start(r: int) -> None:
        beats[r] = rdv.Heartbeat(envs[r], interval_s=interval).start()

    _join_all(_threads(len(envs), start, "beat"))
    return beats


def _heartbeats(rdv, envs, requests, beat_s: float, interval: float):
    beats = _started_heartbeats(rdv, envs, interval)
    time.sleep(interval)  # past the first beat of every thread
    k0, _ = requests.snapshot()
    t0 = time.monotonic()
    time.sleep(beat_s)
    k1, _ = requests.snapshot()
    rate = sum((k1 - k0).values()) / (time.monotonic() - t0)
    return beats, rate


@contextlib.contextmanager
def _no_exit(exits: list, expected: int, all_out: threading.Event):
    """The health watchdog ends its process with os._exit(1); here it only ends its thread (noted in
    `exits`; `all_out` is set once `expected` have)."""
    real_exit, real_err = os._exit, sys.stderr
    lock = threading.Lock()

    def leave(code: int) -> None:
        with lock:
            exits.append(code)
            if len(exits) >= expected:
                all_out.set()
        raise SystemExit(code)

    os._exit, sys.stderr = leave, io.StringIO()
    try:
        yield sys.stderr
    finally:
        os._exit, sys.stderr = real_exit, real_err


def _callers(survivors: list[int], callers: int | None) -> list[int]:
    if not callers or callers >= len(survivors):
        return survivors
    return survivors[:: max(len(survivors) // callers, 1)][:callers]


def _failure(requests, who: list[int], call) -> dict:
    """Run `call(rank)` on every rank in `who` at once; requests and seconds until all have answered."""
    answers: dict[int, str | None] = {}
    n0 = requests.total()
    started = time.monotonic()

    def rank(i: int) -> None:
        r = who[i]
        try:
            answers[r] = call(r)
        except SystemExit:
            answers[r] = "exit"
        except Exception as exc:  # noqa: BLE001 - the answer is the error, as a rank would print it
            answers[r] = f"{type(exc).__name__}: {exc}"

    _join_all(_threads(len(who), rank, "caller"), timeout=600)
    return {"requests": requests.total() - n0, "seconds": round(time.monotonic() - started, 2),
            "callers": len(who), "answers": answers}


def _extrapolate(found: dict, survivors: int) -> dict:
    per_caller = found["requests"] / max(found["callers"], 1)
    out = {"requests_per_caller": round(per_caller, 1), "seconds": found["seconds"], "callers": found["callers"],
           "requests": found["requests"] if found["callers"] >= survivors else round(per_caller * survivors),
           "sampled": found["callers"] < survivors}
    sample = next(iter(found["answers"].values()), None)
    out["answer"] = (sample or "")[:160]
    return out


def _fail_barrier(rdv, stores, envs, requests, callers, timeout):
    """One rank never comes to a collective barrier; the rest time out. `wait_for_all` (the trainer's
    checkpoint barrier) waits and names the missing ranks with the same code as the join, on stores
    already connected: a fresh join would time the VM's slow connects (see _join) instead."""
    world = len(envs)
    absent = world // 2 + 1
    survivors = [r for r in range(world) if r != absent]
    found = _failure(requests, _callers(survivors, callers),
                     lambda r: rdv.wait_for_all(stores[r], envs[r], "save/1", timeout))
    result = _extrapolate(found, len(survivors))
    result["answer"] = f"missing: {next(iter(found['answers'].values()))}"
    return result


def _fail_health(rdv, stores, envs, requests, callers, timeout):
    world = len(envs)
    absent = world // 2 + 1
    for r in range(world):  # a fresh round of health keys: the previous check's are set
        stores[r] = dist.PrefixStore("again", stores[r])
    survivors = [r for r in range(world) if r != absent]
    who = _callers(survivors, callers)
    real_all_reduce = dist.all_reduce
    exits: list[int] = []
    all_out = threading.Event()

    def hang(tensor, *a, **k):
        """The collective hangs (a rank never came) until every watchdog has ended its "process"."""
        all_out.wait(timeout * 60)

    dist.all_reduce = hang
    try:
        with _no_exit(exits, len(who), all_out) as err:
            found = _failure(requests, who, lambda r: rdv.health_check(stores[r], envs[r], torch.device("cpu"),
                                                                       timeout_s=timeout))
    finally:
        dist.all_reduce = real_all_reduce
    result = _extrapolate(found, len(survivors))
    result["answer"] = err.getvalue().splitlines()[0][:160] if err.getvalue() else ""
    return result


def _fail_peer(rdv, beats, stores, envs, requests, callers, interval):
    """One rank's heartbeat stops (the rank died); every survivor's collective fails and asks why, with
    the code's own window (2.5 heartbeats) over the heartbeats already running."""
    world = len(envs)
    dead = world // 2 + 1
    beats[dead].stop()
    time.sleep(interval)  # its last beat is past
    survivors = [r for r in range(world) if r != dead]
    # The code's default window, unless the heartbeats run faster than the code's (--quick).
    window = {} if interval == rdv.HEARTBEAT_S else {"window_s": 2.5 * interval}
    found = _failure(requests, _callers(survivors, callers),
                     lambda r: rdv.explain_failure(stores[r], envs[r], **window))
    return _extrapolate(found, len(survivors))


def run(nodes: int, per_node: int, *, spread: float = 1.0, hold: float = 3.0, window: float = 1.5,
        beat_s: float = 4.0, fail_timeout: float = 2.0, interval: float | None = None,
        callers: int | None = None, seed: int = 0) -> dict:
    from hpc_ddp.job.distenv import from_environ
    from hpc_ddp.job.ports import first_free_port
    from hpc_ddp.trainer import rendezvous as rdv

    threading.stack_size(512 * 1024)
    world = nodes * per_node
    port = first_free_port(24000 + (os.getpid() % 2000))
    envs = []
    for r in range(world):
        env = slurmenv.rank_env(r, nodes, per_node)
        env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(port)
        envs.append(from_environ(env))
    hosts = [f"sim{r // per_node + 1:04d}" for r in range(world)]
    real_all_reduce = dist.all_reduce
    out: dict = {"nodes": nodes, "ranks": world}
    with storecount.counting() as requests:
        t = time.monotonic()
        stores, out["join"] = _join(rdv, envs, hosts, requests, spread=spread, hold=hold, window=window, seed=seed)
        _say("join", t)
        out["join"]["requests"] = requests.total()
        out["join"]["requests_per_rank"] = round(requests.total() / world, 2)
        n0 = requests.total()
        dist.all_reduce = lambda tensor, *a, **k: tensor.fill_(world)
        try:
            t0 = time.monotonic()
            _health(rdv, stores, envs)
        finally:
            dist.all_reduce = real_all_reduce
        out["health"] = {"requests_per_rank": round((requests.total() - n0) / world, 2),
                         "seconds": round(time.monotonic() - t0, 2)}
        _say("health", t0)
        t = time.monotonic()
        interval = interval or rdv.HEARTBEAT_S
        beats, rate = _heartbeats(rdv, envs, requests, beat_s, interval)
        out["heartbeats"] = {"interval_s": interval, "requests_per_s": round(rate, 1)}
        _say("heartbeats", t)
        t = time.monotonic()
        out["fail_peer"] = _fail_peer(rdv, beats, stores, envs, requests, callers, interval)
        for b in beats:
            b.stop()
        _say("a rank stops beating", t)
        t = time.monotonic()
        out["fail_health"] = _fail_health(rdv, stores, envs, requests, callers, fail_timeout)
        _say("a rank misses the health check", t)
        t = time.monotonic()
        out["fail_barrier"] = _fail_barrier(rdv, stores, envs, requests, callers, fail_timeout)
        _say("a rank misses a barrier", t)
        out["requests_by_kind"] = dict(requests.snapshot()[0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--callers", type=int, default=None,
                        help="survivors that call in the failure paths (default: all)")
    parser.add_argument("--quick", action="store_true", help="short holds, windows and heartbeats: a smoke test's")
    args = parser.parse_args()
    print(json.dumps(run(args.nodes, args.per_node, callers=args.callers, **(QUICK if args.quick else {}))))


if __name__ == "__main__":
    main()
