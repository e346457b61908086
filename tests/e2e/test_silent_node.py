"""Issue 53: a node that does not respond is not a lost node. On the test Slurm the batch host's slurmd is
stopped (`kill -STOP`) for 45 s while its job trains, and Slurm marks the node not responding (`*` in
sinfo). The job's processes on it go on (slurmstepd and the ranks are not slurmd), so the batch-host guard
must not requeue it: it waits for SILENT_S (60 s) of silence at every look before it calls the node lost. The
job completes in its first attempt, every sample trained once."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from bench.goodput_bench import slurmd_pids
from hpc_ddp.common.events import read_jsonl
from hpc_ddp.job.hostguard import SILENT_S

from .helpers import job_field, run_through_requeues, wait_until
from .test_restart_in_place import _finish, _submit, trained_once, uninterrupted

pytestmark = pytest.mark.e2e

STOPPED_S = 45.0
assert STOPPED_S < SILENT_S  # the point of the test: silent, but not for as long as a lost node is


def _state(node: str) -> str:
    return subprocess.run(["sinfo", "-h", "-n", node, "-o", "%t"], capture_output=True, text=True).stdout.strip()


@pytest.mark.slurm
@pytest.mark.extended
def test_a_batch_host_whose_slurmd_stops_answering_for_45_s_is_not_lost(slurm_conf, tmp_path):
    job = _submit(tmp_path, "--partition", "debug", "--nodes", "2", env={"KEYS_STEP_S": "1.5"})
    pid = None
    seen: list[str] = []
    try:
        wait_until(lambda: job_field(job, "JobState") == "RUNNING" and list((tmp_path / "keys").glob("*")), 120,
                   "the job to train")
        wait_until(lambda: (tmp_path / "run" / "checkpoints" / "latest").exists(), 120, "the first checkpoint")
        host = job_field(job, "BatchHost")
        found = slurmd_pids(host)   # this test Slurm's, not another's of the same node name
        assert len(found) == 1, found
        pid = found[0]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        # slurmctld pings a node every SlurmdTimeout / 3 (100 s by default); a reconfigure sends every slurmd
        # a message at once, and the one that cannot answer is marked not responding within MessageTimeout
        subprocess.run(["scontrol", "reconfigure"], capture_output=True, timeout=30)
        while time.monotonic() - stopped < STOPPED_S:
            seen.append(_state(host))
            time.sleep(1.0)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
    try:
        assert any(s.endswith("*") for s in seen), seen  # Slurm did see the node as not responding
        assert run_through_requeues(job, timeout=300, run_dir=tmp_path / "run") == "COMPLETED"
    finally:
        _finish(job)
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert not [e for e in events if e.get("event") == "batch_host_lost"], events
    assert [e.get("job_id") for e in events if e.get("event") == "attempt_start"] == [job]
    assert job_field(job, "Restarts") == "0"
    assert trained_once(tmp_path / "keys") == uninterrupted(8)
