"""Helpers for end-to-end tests: run the real CLI, wait for Slurm jobs, read what the ranks recorded."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

PROBE = Path(__file__).parent / "allreduce_probe.py"
# Job states that are not an end: SIGNALING shows for a moment while Slurm sends --signal's warning.
_NOT_ENDED = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "SIGNALING", "STAGE_OUT")


def hpc_ddp(*args: str, cwd: Path, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_ddp", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def copy_probe(directory: Path) -> Path:
    target = directory / "allreduce_probe.py"
    shutil.copy(PROBE, target)
    return target


def wait_for_job(job_id: str, timeout: float = 180, run_dir: Path | None = None) -> str:
    """Poll until the job leaves the queue; return its final state from scontrol (MinJobAge keeps it).
    On a timeout the error carries what Slurm and (given run_dir) the run recorded, for a CI log to say why."""
    deadline = time.monotonic() + timeout
    info = ""
    while time.monotonic() < deadline:
        info = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
        state = re.search(r"JobState=(\S+)", info)
        if state and state.group(1) not in _NOT_ENDED:
            return state.group(1)
        time.sleep(0.5)
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not finish within {timeout} s\n{info}{_run_record(run_dir)}")


def _run_record(run_dir: Path | None) -> str:
    if run_dir is None:
        return ""
    parts = []
    for path in [run_dir / "events.jsonl", *sorted((run_dir / "logs").glob("**/*"))[-6:]]:
        if path.is_file():
            parts.append(f"--- {path.relative_to(run_dir)} (tail) ---\n" + path.read_text(errors="replace")[-3000:])
    return "\n".join(parts)


def read_probe(run_dir: Path) -> list[dict]:
    files = sorted((run_dir / "probe").glob("rank-*.json"))
    return sorted((json.loads(f.read_text()) for f in files), key=lambda r: r["rank"])


def check_probe(seen: list[dict], *, nodes: int, tasks: int, master: str, node_names: list[str] | None) -> None:
    world = nodes * tasks
    assert [r["rank"] for r in seen] == list(range(world))
    ports = {r["MASTER_PORT"] for r in seen}
    assert len(ports) == 1, ports
    gpus_seen = set()
    for r in seen:
        rank = r["rank"]
        assert r["world_size"] == world and r["WORLD_SIZE"] == str(world)
        assert r["all_reduce"] == sum(range(world))
        assert r["LOCAL_RANK"] == str(rank % tasks) and r["NODE_RANK"] == str(rank // tasks)
        assert r["LOCAL_WORLD_SIZE"] == str(tasks) and r["MASTER_ADDR"] == master
        if node_names:
            assert r["SLURMD_NODENAME"] == node_names[rank // tasks]
        # Exactly one GPU per rank: its own, by local rank, on its own node. The default binding (auto) shows
        # every rank the node's GPUs, so cuda:LOCAL_RANK exists, and starts it on its own one.
        visible = r["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible == [str(i) for i in range(tasks)] and r["HPC_DDP_GPU_BINDING"] == "node", r
        own = visible[int(r["HPC_DDP_CUDA_DEVICE"])]
        assert own == str(rank % tasks), r
        gpus_seen.add((r["NODE_RANK"], own))
        assert r["BACKEND"] == "gloo"
    assert len(gpus_seen) == world


def job_field(job_id: str, field: str) -> str | None:
    info = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    m = re.search(rf"\b{field}=(\S+)", info)
    return m.group(1) if m else None


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2, explain=None):
    """Poll `predicate` until it is true; on a timeout the error carries `explain()` (what Slurm and the
    run recorded), so that a CI log says why."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f"\n{explain()}" if explain else ""))


def explain_job(job_id: str) -> str:
    """What Slurm shows of a job (scontrol, sacct's steps) and what its run dir recorded (found from the
    job's StdOut, RUN_DIR/logs/slurm-N.out)."""
    info = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    steps = subprocess.run(["sacct", "-P", "-j", job_id, "-o", "JobID,State,ExitCode,NodeList,Start,End"],
                           capture_output=True, text=True).stdout
    out = re.search(r"StdOut=(\S+)", info)
    run_dir = Path(out.group(1)).parent.parent if out else None
    return f"{info}{steps}{_run_record(run_dir if run_dir and (run_dir / 'events.jsonl').exists() else None)}"


def last_step(run_dir: Path) -> int:
    from hpc_ddp.common.events import read_jsonl

    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    return steps[-1] if steps else 0


# A requeued job's old run had its credential revoked by each slurmd at the second it was killed, and
# slurmd refuses a launch whose credential was made in that same second or before ("Job credential
# revoked": the job ends FAILED, or is held). Slurm's ~120 s wait before a requeued job may start again
# is for this. Once the job is PENDING (its nodes released), or another job ran on its nodes, the
# revocation lies in the past: one second more and a new credential is always newer.
CREDENTIAL_SECOND_S = 1.5


def release_when_requeued(job_id: str, timeout: float = 60) -> None:
    """A requeued job waits ~120 s before it may start again; tests start it at once."""
    wait_until(lambda: job_field(job_id, "JobState") == "PENDING", timeout, f"job {job_id} to be requeued")
    time.sleep(CREDENTIAL_SECOND_S)
    start_now(job_id)


def start_now(job_id: str) -> None:
    """Let a requeued job start at once. Started too soon after all, Slurm's batch launch fails ("Job
    credential revoked") and Slurm holds the job ("launch failed requeued held"): release it then. A
    user's job, which waits Slurm's own delay, never meets this."""
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
    if "held" in (job_field(job_id, "Reason") or "").lower():
        subprocess.run(["scontrol", "release", job_id], capture_output=True)


def run_through_requeues(job_id: str, timeout: float = 600, run_dir: Path | None = None) -> str:
    """Release every requeue of the job at once until it ends; its final state. On a timeout the error
    carries what Slurm and (given run_dir) the run recorded, as wait_for_job's does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job_field(job_id, "JobState")
        if state not in (*_NOT_ENDED, None):
            return state
        if state == "PENDING" and job_field(job_id, "Restarts") not in (None, "0"):
            time.sleep(CREDENTIAL_SECOND_S)
            start_now(job_id)
        time.sleep(1)
    info = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    steps = subprocess.run(["sacct", "-P", "-j", job_id, "-o", "JobID,State,NodeList,Start,End"],
                           capture_output=True, text=True).stdout
    subprocess.run(["scancel", job_id])
    raise AssertionError(f"job {job_id} did not finish within {timeout} s\n{info}{steps}{_run_record(run_dir)}")


def preempt(job_id: str) -> None:
    """Preempt `job_id` for real: a job in the `urgent` partition (PriorityTier 100) that needs both nodes
    whole; once it ran, release the requeued job at once instead of Slurm's ~120 s hold."""
    restarts = int(job_field(job_id, "Restarts") or 0)
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-N2", "--exclusive", "-o", "/dev/null",
                             "--wrap", "sleep 1"], capture_output=True, text=True, check=True).stdout.strip()
    wait_until(lambda: int(job_field(job_id, "Restarts") or 0) > restarts, 90, f"job {job_id} to be requeued",
               explain=lambda: explain_job(job_id))
    wait_until(lambda: job_field(urgent, "JobState") in ("COMPLETED", "FAILED", "CANCELLED", None), 60,
               f"urgent job {urgent} to end")
    time.sleep(CREDENTIAL_SECOND_S)
    start_now(job_id)


def submit_json(*args: str, cwd: Path, env: dict | None = None) -> dict:
    done = hpc_ddp("submit", "--json", *args, cwd=cwd, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout[done.stdout.index("{"):])


# A model module whose step time is pinned (0.25 s), for runs that must outlast a short time limit
# however fast the machine is: load it with model = "slowmodel:make" after writing it as slowmodel.py.
SLOW_MODEL = """
import time
from torch import nn


class SlowLinear(nn.Module):
    def __init__(self, num_classes, in_channels, image_size):
        super().__init__()
        self.fc = nn.Linear(in_channels * image_size * image_size, num_classes)

    def forward(self, x):
        time.sleep(0.25)
        return self.fc(x.flatten(1))


def make(**kwargs):
    return SlowLinear(**kwargs)
"""


def unix_listening(path: str) -> bool:
    """Something listens on the Unix socket `path` now (/proc/net/unix: flag __SO_ACCEPTCON). A socket file
    alone says nothing: one left by a killed process stays until the next listener replaces it."""
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == path and int(fields[3], 16) & 0x10000:
                return True
    return False


def stop(proc: subprocess.Popen | None, grace_s: float = 10) -> None:
    """End a helper process the way a user does (SIGTERM: it cleans up), and kill it only if it will not."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def trained_keys(folder: Path):
    """The (epoch, index) multiset that elastic_keys.py's ranks wrote they trained (keys-*.jsonl in `folder`)."""
    import collections

    found = collections.Counter()
    for path in folder.glob("keys-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            found.update((record["epoch"], k) for k in record["keys"])
    return found
