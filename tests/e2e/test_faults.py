"""Rendezvous faults end the job fast and say who: a taken port, a rank that never joins, a rank that
hangs mid-training (local executor and the real Slurm)."""

import json
import re
import socket
import subprocess
import time

import pytest

from hpc_ddp.common.events import read_jsonl
from hpc_ddp.job.ports import first_free_port

from .helpers import hpc_ddp, submit_json, wait_for_job, wait_until

pytestmark = pytest.mark.e2e

JOB = """nodes = 2
tasks_per_node = {tasks}
[train]
dataset = "fake"
fake_size = 1024
image_size = 8
model = "mlp"
epochs = 4
batch_size = 16
num_workers = 0
log_every = 5
eval_every_epoch = false
"""


@pytest.fixture
def workspace(tmp_path):
    (tmp_path / "job.toml").write_text(JOB.format(tasks=1))
    (tmp_path / "job4.toml").write_text(JOB.format(tasks=2))
    return tmp_path


def _local(workspace, *args, env=None, timeout=120):
    started = time.monotonic()
    done = hpc_ddp("submit", "--executor", "local", *args, "job.toml", cwd=workspace, env=env, timeout=timeout)
    return done, time.monotonic() - started, done.stdout + done.stderr  # rank lines are echoed to stdout


def test_a_taken_master_port_fails_in_seconds_naming_it(workspace):
    port = first_free_port(26000)
    with socket.socket() as holder:
        holder.bind(("", port))
        holder.listen()
        done, took, out = _local(workspace, "--master-port", str(port), "--run-dir", "taken")
    assert done.returncode != 0 and took < 30, (took, out[-2000:])
    assert f"MASTER_PORT {port} is already in use on {socket.gethostname()}" in out
    assert "HINT: choose another: hpc-ddp submit --master-port N" in out


def test_a_rank_that_never_joins_is_named_within_the_rendezvous_timeout(workspace):
    done, took, out = _local(workspace, "--rendezvous-timeout", "8", "--run-dir", "nojoin",
                        env={"HPC_DDP_FAULT_NO_JOIN": "1"})
    assert done.returncode == 1, out[-2000:]
    assert "rank 1 (localhost) did not join the rendezvous within 8 s (1 of 2 ranks did)" in out
    assert took < 8 + 30, took  # start-up + the timeout + stopping the other rank; not torch's 30 minutes


def test_a_hung_rank_ends_the_job_within_the_collective_timeout(workspace):
    done, took, out = _local(workspace, "--collective-timeout", "10", "--run-dir", "hang",
                        env={"HPC_DDP_FAULT_HANG_AT": "5:1"})
    assert done.returncode == 1, out[-2000:]
    # Named by whichever notices first: the broken collective (its timeout, 10 s), or the stall watch (no
    # step for 10 s: the same limit, so on a loaded machine it can be first); either names rank 1.
    assert re.search(r"\[rank 0\] hpc-ddp(?: train)?: error: rank 0: (?:no step completed for \d+ s [^\n]*; )?"
                     r"rank 1 \(localhost\) stopped responding \(no heartbeat for 5 s\): it died or hung",
                     out), out[-3000:]
    assert took < 10 + 45, took
    events = read_jsonl(workspace / "hang" / "events.jsonl")
    assert events[-1]["event"] == "attempt_end" and events[-1]["cause"] in ("failed", "stalled")


@pytest.mark.slurm
def test_on_slurm_a_hung_rank_on_the_second_node_is_named_with_its_host(slurm_conf, workspace):
    started = time.monotonic()
    # --max-restarts 0: what is tested is the hung rank named, not the restart in place that follows it.
    job = submit_json("--collective-timeout", "15", "--max-restarts", "0", "--run-dir", "slurm-hang", "job4.toml",
                      cwd=workspace,
                      env={"HPC_DDP_FAULT_HANG_AT": "5:3"})["job_id"]
    assert wait_for_job(job, timeout=180) == "FAILED"
    took = time.monotonic() - started
    logs = hpc_ddp("logs", job, cwd=workspace).stdout
    assert re.search(r"rank 3 \(hpcn2\) stopped responding \(no heartbeat for 5 s\): it died or hung", logs), logs[-3000:]
    assert took < 15 + 90, took
    status = hpc_ddp("status", "--json", job, cwd=workspace)
    # The stall watch's own record names it (issue 43: status takes it as the failure), or the heartbeats do.
    failure = json.loads(status.stdout)["failure"]
    assert failure["kind"] in ("stalled", "rank_lost") and "rank 3" in json.dumps(failure), status.stdout
    wait_until(lambda: subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True).stdout.strip() == "",
               60, "the job to leave the queue")
