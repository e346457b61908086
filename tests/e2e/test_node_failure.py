"""A node that dies mid-run costs one requeue and no checkpoint (issue 32), on the real test Slurm: the node
running a 1-node trainer job loses its slurmd, its slurmstepd and the job's processes, and is set DOWN;
Slurm requeues the job (NODE_FAIL), the next attempt records the lost node as `node_failure`, runs on the
node that is up, resumes from the last checkpoint and completes. The node is brought back afterwards."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bench.goodput_bench import kill_at_once, slurmd_pids
from hpc_ddp.common.events import read_jsonl

from .helpers import SLOW_MODEL, hpc_ddp, job_field, run_through_requeues, submit_json, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

JOB = """nodes = 1
tasks_per_node = 1
[train]
dataset = "fake"
fake_size = 4096
image_size = 8
model = "slowmodel:make"
epochs = 1
max_steps = 60
batch_size = 8
num_workers = 0
log_every = 5
checkpoint_every_steps = 5
eval_every_epoch = false
"""


def _job_processes(job_id: str) -> list[int]:
    """The processes of `job_id` on this machine: its slurmstepds ([J.batch], [J.0], ...) and every process
    whose environment names the job (the batch shell, srun, the ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if (cmdline.startswith(b"slurmstepd") and f"[{job_id}.".encode() in cmdline) or \
                f"SLURM_JOB_ID={job_id}\0".encode() in environ:
            found.append(int(entry.name))
    return found


def _slurmd_of(node: str) -> list[int]:
    return slurmd_pids(node)   # this test Slurm's, not another's of the same node name


def _kill_node(node: str, job_id: str) -> None:
    kill_at_once(_slurmd_of(node) + _job_processes(job_id))
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=hpc-ddp test: node killed"],
                   check=True, capture_output=True)


def _bring_back(node: str, conf: str) -> None:
    root = Path(conf).parent
    if not _slurmd_of(node):
        subprocess.run(["slurmd", "-N", node, "-L", str(root / "log" / f"slurmd-{node}.log")],
                       env={**os.environ, "SLURM_CONF": conf}, check=True)
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
    wait_until(lambda: subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True,
                                      text=True).stdout.strip() == "idle", 60, f"{node} to be idle again")


def test_a_killed_node_costs_one_requeue_and_the_job_completes_on_the_other(slurm_conf, tmp_path):
    (tmp_path / "slowmodel.py").write_text(SLOW_MODEL)
    (tmp_path / "job.toml").write_text(JOB)
    job = submit_json("--partition", "debug", "--run-dir", "run", "job.toml", cwd=tmp_path)["job_id"]
    run = tmp_path / "run"
    node = None
    try:
        wait_until(lambda: (run / "checkpoints" / "latest").exists(), 180, "a first checkpoint")
        node = subprocess.run(["squeue", "-h", "-j", job, "-o", "%N"], capture_output=True, text=True).stdout.strip()
        assert node in ("hpcn1", "hpcn2"), node
        _kill_node(node, job)
        assert run_through_requeues(job, timeout=420) == "COMPLETED"
    finally:
        if job_field(job, "JobState") not in (None, "COMPLETED", "FAILED", "CANCELLED"):
            subprocess.run(["scancel", job])
        if node:
            _bring_back(node, slurm_conf)
    events = read_jsonl(run / "events.jsonl")
    lost = [e for e in events if e.get("event") == "attempt_end" and e.get("cause") == "node_failure"]
    assert len(lost) == 1 and lost[0]["nodes"] == node and lost[0]["attempt"] == 0, events
    starts = [e for e in events if e.get("event") == "attempt_start"]
    assert len(starts) == 2 and starts[1]["nodes"] != node and starts[1]["checkpoint_step"] >= 5
    resumed = [e for e in events if e.get("event") == "resume"]
    assert resumed and resumed[0]["step"] >= 5 and events[-1]["event"] == "attempt_end"
    assert [e for e in events if e.get("event") == "finish"]
    assert "1 lost node" in hpc_ddp("timeline", "run", cwd=tmp_path).stdout
