"""The launcher-side work over a run dir at `nodes` x `per_node` ranks with hundreds of attempts:
`hpc_ddp.job.attempts` begin/finish for every attempt (what the batch script runs around each srun),
then `hpc_ddp.watch.status.run_status` over the result (what `hpc-ddp status` prints).

The run dir is real (in /dev/shm where it fits: see _memory_dir): `attempts` writes events.jsonl
itself; the trainer's records (start/resume, the stop signal, the checkpoint pointer, a few metrics per
attempt) and every rank's log file (logs/job-J/attempt-N/rank-R.log, as Slurm writes them) are written
by this simulation. The run is
`jobs` submissions of `per_job` attempts each (each attempt preempted after a checkpoint and requeued);
the last attempt fails, so `status` also reads the logs to name the failure.

Measured: seconds and shared-FS metadata ops per begin/finish pair (mean over the attempts), and for
`run_status`: seconds, metadata ops and directory entries read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.scale import fsops, slurmenv

__all__ = ["run"]


class _NoSlurm:
    """A CommandRunner with no Slurm commands: status reads only the run dir."""

    def which(self, name: str) -> None:
        return None

    def run(self, argv, **kwargs):  # pragma: no cover - which() says there is nothing to run
        raise AssertionError(f"no commands here: {argv}")


def _spec(run_dir: Path, nodes: int, per_node: int, cap: int) -> None:
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec

    spec = build_spec([Layer("sim", {"nodes": nodes, "tasks_per_node": per_node, "max_preemptions": cap,
                                     "max_requeues": cap})],
                      target=Target("script", "/t.py"), workdir="/", python="python")
    (run_dir / "spec.json").write_text(json.dumps(spec.to_dict()))


def _trainer_records(run_dir: Path, step: int, first: bool) -> None:
    """What the trainer writes in one attempt: start/resume, metrics, the stop and its checkpoint."""
    from hpc_ddp.common.events import JsonLines

    events, metrics = JsonLines(run_dir / "events.jsonl"), JsonLines(run_dir / "metrics.jsonl")
    events.write({"event": "start" if first else "resume", "step": step, "total_steps": 10**6, "epoch": 0,
                  "path": f"checkpoints/step-{step}"})
    for s in range(step + 10, step + 60, 10):
        metrics.write({"step": s, "loss": 1.0, "samples_per_s": 1000.0})
    events.write({"event": "signal", "signal": "SIGTERM", "cause": "preempted", "step": step + 50})
    events.write({"event": "requeue_requested", "step": step + 50, "exit_code": 75})
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    (run_dir / "checkpoints" / "latest").write_text(f"step-{step + 50}\n")


def _attempts(run_dir: Path, nodes: int, jobs: int, per_job: int, ops: fsops.Ops) -> dict:
    from hpc_ddp.job import attempts

    seconds, counted = 0.0, 0
    for job in range(jobs):
        env = {"HPC_DDP_JOB_ID": str(5000 + job), "SLURM_JOB_NODELIST": slurmenv.nodelist(nodes)}
        for a in range(per_job):
            last = job == jobs - 1 and a == per_job - 1
            before, t0 = ops.total(), time.perf_counter()
            ok, reason = attempts.begin(run_dir, a, env)
            seconds += time.perf_counter() - t0
            counted += ops.total() - before
            if not ok:
                raise RuntimeError(f"job {job} attempt {a} not admitted: {reason}")
            step = (job * per_job + a) * 50
            if not last:
                _trainer_records(run_dir, step, first=job == 0 and a == 0)
            before, t0 = ops.total(), time.perf_counter()
            attempts.finish(run_dir, a, 1 if last else 75, env, ask_slurm=lambda _job: None)
            seconds += time.perf_counter() - t0
            counted += ops.total() - before
    n = jobs * per_job
    return {"attempts": n, "ms_per_attempt": round(1000 * seconds / n, 2),
            "shared_ops_per_attempt": round(counted / n, 1)}


def _logs(run_dir: Path, world: int, jobs: int, per_job: int) -> int:
    """Every rank's log of every attempt; the last attempt's rank 3 died of an exception."""
    files = 0
    line = b"step 100 loss 0.25 samples/s 1000\n" * 4
    for job in range(jobs):
        for a in range(per_job):
            where = run_dir / "logs" / f"job-{5000 + job}" / f"attempt-{a}"
            where.mkdir(parents=True)
            for r in range(world):
                fd = os.open(where / f"rank-{r}.log", os.O_WRONLY | os.O_CREAT, 0o644)
                os.write(fd, line)
                os.close(fd)
                files += 1
    last = run_dir / "logs" / f"job-{5000 + jobs - 1}" / f"attempt-{per_job - 1}" / f"rank-{min(3, world - 1)}.log"
    last.write_text('Traceback (most recent call last):\n  File "t.py", line 1\nValueError: bad shard\n')
    return files


def _memory_dir(files: int) -> str | None:
    """/dev/shm where it can hold `files` small logs twice over (a page and an inode each), else the
    default temp dir. On the VM's disk, creating and deleting 409,600 files takes minutes and times the
    disk's journal, not `status`; the operations counted are the same on either."""
    try:
        fs = os.statvfs("/dev/shm")
    except OSError:
        return None
    room = fs.f_bavail * fs.f_frsize > 2 * files * 8192 and fs.f_favail > 2 * files
    return "/dev/shm" if room and os.access("/dev/shm", os.W_OK) else None


def run(nodes: int, per_node: int, *, jobs: int = 10, per_job: int = 20) -> dict:
    from hpc_ddp.watch.status import run_status

    world = nodes * per_node
    where = _memory_dir(world * jobs * per_job)
    with tempfile.TemporaryDirectory(prefix="hpc-ddp-scale-rundir-", dir=where) as tmp:
        run_dir = Path(tmp) / "run"
        run_dir.mkdir()
        os.environ["HPC_DDP_REGISTRY"] = str(Path(tmp) / "registry.jsonl")  # not this user's real registry
        _spec(run_dir, nodes, per_node, cap=per_job + 1)
        ops = fsops.Ops([str(run_dir)])
        with fsops.counting(ops):
            out = {"nodes": nodes, "ranks": world, "attempts": _attempts(run_dir, nodes, jobs, per_job, ops)}
        t0 = time.perf_counter()
        out["log_files"] = _logs(run_dir, world, jobs, per_job)
        out["seconds_to_write_logs"] = round(time.perf_counter() - t0, 1)
        ops = fsops.Ops([str(run_dir)])
        with fsops.counting(ops):
            t0 = time.perf_counter()
            status = run_status(run_dir, str(5000 + jobs - 1), "sbatch", _NoSlurm())
            seconds = time.perf_counter() - t0
        out["status"] = {"seconds": round(seconds, 3), "shared_ops": ops.total(),
                         "entries_listed": ops.snapshot()[("shared", "entries")], "ops_by_kind": ops.by_op(),
                         "state": status["state"], "attempts_shown": len(status["attempts"]),
                         "failure": (status["failure"] or {}).get("detail")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--per-job", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="2 jobs of 5 attempts: a smoke test's run dir")
    args = parser.parse_args()
    jobs, per_job = (2, 5) if args.quick else (args.jobs, args.per_job)
    print(json.dumps(run(args.nodes, args.per_node, jobs=jobs, per_job=per_job)))


if __name__ == "__main__":
    main()
