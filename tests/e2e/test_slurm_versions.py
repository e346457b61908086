"""The preemption a Slurm version decides differently, on the test Slurm that is up (22.05 in make test's
suite; 24.11 and 26.05 in its version smoke and in make test-slurm-versions): the README's Session script,
preempted for real once, with a GraceTime (partition grace) and without (debug), resumes exactly and ends
COMPLETED with exactly one restart, whoever requeued it (Slurm 24.05 and later requeue a job preempted in
its GraceTime themselves: slurm/jobview.py).

HPC_DDP_GRACE_LOOP=N runs each case N times (issue 51's 10-of-10 figure; outside make test):
    HPC_DDP_GRACE_LOOP=10 bash tests/run-versions.sh 22.05 24.11 26.05 -- -k grace_time
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl

from .helpers import hpc_ddp, last_step, preempt, run_through_requeues, submit_json, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "preemptible.py"
EPOCHS = "200"  # 6,400 steps over 2 ranks: long enough to be preempted at step 300 on a loaded machine
ROUNDS = range(int(os.environ.get("HPC_DDP_GRACE_LOOP", "1")))


def _sha(run_dir: Path) -> tuple[int, str]:
    done = hpc_ddp("inspect", "--json", str(run_dir), cwd=run_dir)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    return info["step"], info["model_sha256"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The same script, uninterrupted, on 2 ranks through the local executor (the same arithmetic)."""
    root = tmp_path_factory.mktemp("versions-base")
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "2", "--tasks-per-node", "1", "--run-dir", "base",
                   str(EXAMPLE), cwd=root, env={"EPOCHS": EPOCHS}, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _sha(root / "base")


@pytest.mark.slurm_smoke
@pytest.mark.slurm_core
@pytest.mark.parametrize("round_", ROUNDS)
@pytest.mark.parametrize("partition", ["grace", "debug"])
def test_a_session_preempted_with_and_without_a_grace_time_resumes_exactly_with_one_restart(
        slurm_conf, tmp_path, baseline, partition, round_):
    job = submit_json("--partition", partition, "--nodes", "2", "--gpus", "1", "--run-dir", "run", str(EXAMPLE),
                      cwd=tmp_path, env={"EPOCHS": EPOCHS})["job_id"]
    run_dir = tmp_path / "run"
    wait_until(lambda: last_step(run_dir) >= 300, 300, "step 300")
    preempt(job)
    assert run_through_requeues(job, timeout=600, run_dir=run_dir) == "COMPLETED"
    assert _sha(run_dir) == baseline
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["cause"] for e in events if e["event"] == "attempt_end"] == ["preempted", "completed"], events
    requeues = [e for e in events if e["event"] == "requeue"]
    assert len(requeues) == 1 and not [e for e in events if e["event"] in ("skipped", "gave_up")], events
    # Who requeued it: Slurm itself at GraceTime 0; with a GraceTime, hpc-ddp before Slurm 24.05, Slurm after.
    version = tuple(int(x) for x in os.environ.get("HPC_DDP_SLURM_VERSION", "22.05").split("."))
    by_slurm = partition == "debug" or version >= (24, 5)
    assert requeues[0].get("by") == ("slurm" if by_slurm else None), requeues
    status = json.loads(hpc_ddp("status", "--json", job, cwd=tmp_path).stdout)
    assert status["state"] == "COMPLETED" and status["restarts"] == 1, status
    runs = subprocess.run(["sacct", "-n", "-X", "-P", "-D", "-j", job, "-o", "State"], capture_output=True,
                          text=True).stdout.split()
    assert len(runs) == 2 and runs[-1] == "COMPLETED", runs
