"""The staging step of a job at `nodes` x `per_node` ranks: `hpc_ddp.job.stagejob.stage_for_job` on
every rank, with a real dataset on a simulated shared filesystem, a scratch dir per simulated node, and
the real run dir. Each simulated node is a process (forked), its ranks are threads: one process of
2,048 threads spends its time handing Python's GIL around, which no real node does.

Each node's local rank 0 stages for real (`staging.stage`: walk, copy, verify, marker), after a drawn
delay that stands for a copy of a large dataset (uniform in [0, spread] s). One node, the straggler, is
held back until every other node has staged plus `hold` seconds: meanwhile every other rank waits in the
barrier, which is the steady state measured:

- shared-FS metadata ops/s while the ranks wait (the last `window` seconds of the hold), as measured on
  this machine, and as asked: at the polling intervals the code sleeps for. On 2 cores, thousands of
  ranks that each stat hundreds of files per poll are CPU-bound and poll less often than they ask to;
  "asked" is what they would do with a core each: waiting ranks x (their ops / the seconds they asked to
  sleep).
- time to all-ready: from the straggler's staging done to the last rank returning.
- every shared-FS op of the whole step, per rank, and the per-rank env derivation (`from_environ`).
"""

from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing as mp
import os
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.scale import fsops, sleeps, slurmenv

__all__ = ["run"]

SAMPLE_S = 0.2  # how often each node process notes its counters (the window is read off these, interpolated)
QUICK = {"spread": 0.2, "hold": 1.0, "window": 0.5}  # --quick: every path runs, the rates are rougher


def _dataset(root: Path, files: int) -> Path:
    src = root / "datasets" / "mnist"
    for i in range(files):
        path = src / f"class_{i % 4}" / f"{i:04d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(1024))
    return src


class _Node:
    """What one simulated node does: its ranks stage, and its counters are sampled over time."""

    def __init__(self, node: int, per_node: int, nodes: int, spec, run_dir: Path, scratch: Path, delay: float,
                 release, events, roots: tuple[str, str]):
        self.node, self.per_node, self.nodes = node, per_node, nodes
        self.spec, self.run_dir, self.scratch, self.delay = spec, run_dir, scratch, delay
        self.release, self.events = release, events
        self.ops = fsops.Ops([roots[0]], [roots[1]])
        self.samples: list[tuple[float, int, float]] = []  # (time, shared ops, seconds the ranks asked to sleep)
        self.returned: list[float] = []
        self.errors: list[str] = []

    def main(self) -> None:
        from hpc_ddp.job import stagejob
        from hpc_ddp.job.distenv import from_environ

        real_stage, real_which = stagejob.stage, shutil.which

        def slow_stage(source, where, **kw):
            """The real stage(), after the time a big copy would take on this node."""
            if self.release is not None:
                self.release.wait()
            else:
                sleeps.real_sleep(self.delay)
            t0 = time.time()
            result = real_stage(source, where, **kw)
            self.events.put(("staged", self.node, time.time(), time.time() - t0))
            return result

        def rank(r: int) -> None:
            env = slurmenv.rank_env(r, self.nodes, self.per_node, tmpdir=str(self.scratch))
            try:
                stagejob.stage_for_job(self.spec, from_environ(env), self.run_dir, env, log=lambda _m: None)
                self.returned.append(time.time())
            except Exception as exc:  # noqa: BLE001 - reported, not raised: the other ranks still count
                self.errors.append(f"rank {r}: {type(exc).__name__}: {exc}")

        stagejob.stage = slow_stage
        # stage() copies with `cp` where there is one; forking that from a process of many threads is
        # slow here and not what is measured, so the copies take stage()'s fallback for machines without
        # cp (shutil, in process).
        shutil.which = lambda name, *a, **k: None if name == "cp" else real_which(name, *a, **k)
        with fsops.counting(self.ops), sleeps.recording() as slept:
            first = self.node * self.per_node
            threads = [threading.Thread(target=rank, args=(r,), name=f"rank-{r}")
                       for r in range(first, first + self.per_node)]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                self.samples.append((time.time(), self.ops.total("shared"), sum(slept.snapshot().values())))
                sleeps.real_sleep(SAMPLE_S)
            self.samples.append((time.time(), self.ops.total("shared"), sum(slept.snapshot().values())))
        self.events.put(("done", self.node, {
            "samples": self.samples, "returned": self.returned, "errors": self.errors,
            "shared_by_kind": self.ops.by_op("shared"), "shared": self.ops.total("shared"),
            "local": self.ops.total("local")}))


def _at(samples: list[tuple[float, int, float]], t: float, column: int) -> float:
    """A node's counter at time t, interpolated between the samples taken around it."""
    times = [s[0] for s in samples]
    i = bisect.bisect_right(times, t)
    if i == 0 or i == len(samples):
        return samples[min(i, len(samples) - 1)][column] if samples else 0.0
    (ta, *a), (tb, *b) = samples[i - 1], samples[i]
    share = (t - ta) / (tb - ta) if tb > ta else 0.0
    return a[column - 1] + share * (b[column - 1] - a[column - 1])


def _env_ms(nodes: int, per_node: int) -> float:
    """Mean ms of from_environ over every rank's Slurm environment."""
    from hpc_ddp.job.distenv import from_environ

    envs = [slurmenv.rank_env(r, nodes, per_node) for r in range(nodes * per_node)]
    from_environ(envs[0])  # once untimed: the first call compiles the hostlist patterns
    t0 = time.perf_counter()
    for env in envs:
        from_environ(env)
    return 1000 * (time.perf_counter() - t0) / len(envs)


def run(nodes: int, per_node: int, *, files: int = 64, spread: float = 1.0, hold: float = 4.0,
        window: float = 2.0, seed: int = 0) -> dict:
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec

    env_ms = _env_ms(nodes, per_node)
    ctx = mp.get_context("fork")
    # The nodes' local disks are in memory where there is a tmpfs: every stage() fsyncs each file it
    # copies, and 256 nodes' fsyncs on one VM disk would time that disk, not the barrier.
    local_base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="hpc-ddp-scale-stage-") as tmp, \
            tempfile.TemporaryDirectory(prefix="hpc-ddp-scale-nodes-", dir=local_base) as nodes_tmp:
        shared, local = Path(tmp) / "shared", Path(nodes_tmp)
        src, run_dir = _dataset(shared, files), shared / "run"
        run_dir.mkdir(parents=True)
        spec = build_spec([Layer("sim", {"datasets": [f"{src}:mnist"], "stage_timeout": 600})],
                          target=Target("script", "/t.py"), workdir="/", python="python")
        rng = random.Random(seed)
        delays = [rng.uniform(0, spread) for _ in range(nodes)]
        straggler = nodes // 2
        release, events = ctx.Event(), ctx.Queue()
        procs = []
        started = time.time()
        for n in range(nodes):
            node = _Node(n, per_node, nodes, spec, run_dir, local / f"node-{n:04d}", delays[n],
                         release if n == straggler else None, events, (str(shared), str(local)))
            procs.append(ctx.Process(target=node.main, daemon=True))
            procs[-1].start()
        staged: dict[int, tuple[float, float]] = {}
        done: dict[int, dict] = {}

        def hear() -> None:
            """The next message from a node; a node whose ranks failed ends the run, saying why."""
            while True:
                try:
                    kind, n, *rest = events.get(timeout=5)
                    break
                except queue.Empty:
                    crashed = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in done]
                    if crashed:  # a node process that died outside its ranks: the barrier would wait for it
                        release.set()
                        raise RuntimeError(f"node {crashed[0]}'s process ended with exit code "
                                           f"{procs[crashed[0]].exitcode} before it said how") from None
                    if not any(p.is_alive() for p in procs):
                        raise RuntimeError(f"every node process ended, {len(done)} of {nodes} said how") from None
            if kind == "staged":
                staged[n] = (rest[0], rest[1])
                return
            done[n] = rest[0]
            if rest[0]["errors"]:
                release.set()
                raise RuntimeError(f"node {n}: {len(rest[0]['errors'])} ranks failed, first: {rest[0]['errors'][:1]}")

        while len(staged) < nodes - 1:
            hear()
        others_staged = time.time()
        time.sleep(hold - window)
        t0 = time.time()
        time.sleep(window)
        t1 = time.time()
        release.set()
        while len(done) < nodes:
            hear()
        for p in procs:
            p.join(30)
    errors = [e for d in done.values() for e in d["errors"]]
    if errors:
        raise RuntimeError(f"{len(errors)} ranks failed, first: {errors[:1]}")
    waiting = [d for n, d in done.items() if n != straggler]  # the straggler's ranks are still staging
    in_window = sum(_at(d["samples"], t1, 1) - _at(d["samples"], t0, 1) for d in waiting)
    asked_sleep = sum(_at(d["samples"], t1, 2) - _at(d["samples"], t0, 2) for d in waiting)
    by_kind: dict[str, int] = {}
    for d in done.values():
        for kind, count in d["shared_by_kind"].items():
            by_kind[kind] = by_kind.get(kind, 0) + count
    total = sum(d["shared"] for d in done.values())
    world = nodes * per_node
    calls = [s[1] for s in staged.values()]
    return {
        "nodes": nodes, "ranks": world, "dataset_files": files, "env_ms_per_rank": round(env_ms, 3),
        "ranks_ready": sum(len(d["returned"]) for d in done.values()),
        "time_to_all_ready_s": round(max(max(d["returned"]) for d in done.values()) - staged[straggler][0], 3),
        "wall_s": round(time.time() - started, 2),
        "others_staged_after_s": round(others_staged - started, 2),
        "stage_call_s": {"mean": round(sum(calls) / len(calls), 3), "max": round(max(calls), 3)},
        "shared_ops_per_s_measured": round(in_window / (t1 - t0), 1),
        "shared_ops_per_s_asked": round(len(waiting) * per_node * in_window / asked_sleep, 1) if asked_sleep else 0.0,
        "shared_ops_total": total, "shared_ops_per_rank": round(total / world, 2), "shared_ops_by_kind": by_kind,
        "local_ops_total": sum(d["local"] for d in done.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="short holds and windows: a smoke test's timings")
    args = parser.parse_args()
    print(json.dumps(run(args.nodes, args.per_node, **(QUICK if args.quick else {}))))


if __name__ == "__main__":
    main()
