"""A rank that hangs ends the attempt within the derived limit, naming the rank and its node (issue 32), on
the local executor: rank 1 SIGSTOPs itself at step 20; with a floor of 3 s the attempt ends in seconds,
not at the collective timeout (600 s), and status shows the line."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from .helpers import hpc_ddp

pytestmark = pytest.mark.e2e


def test_a_stopped_rank_ends_the_attempt_naming_it(tmp_path):
    shutil.copy(Path(__file__).with_name("stall_probe.py"), tmp_path)
    started = time.monotonic()
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "2", "--run-dir", "run", "stall_probe.py",
                   cwd=tmp_path, env={"HPC_DDP_STALL_MIN_S": "3"}, timeout=240)
    took = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "no step completed for" in out and "rank 1 (localhost) stopped responding" in out, out
    assert took < 120   # the collective timeout is 600 s
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    stalled = [e for e in events if e["event"] == "stalled"]
    assert len(stalled) == 1 and "rank 1" in stalled[0]["reason"] and stalled[0]["step"] >= 20
    status = hpc_ddp("status", "run", cwd=tmp_path)
    assert "rank 1 (localhost) stopped responding" in status.stdout


def test_the_only_rank_of_a_run_that_deadlocks_ends_its_attempt_too(tmp_path):
    """Issue 53: a world of one had no stall watch, so a single-GPU job that deadlocked held its GPU until
    the time limit. Now it ends, named, within the limit."""
    shutil.copy(Path(__file__).with_name("stall_probe.py"), tmp_path)
    started = time.monotonic()
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "1", "--run-dir", "run", "stall_probe.py",
                   cwd=tmp_path, env={"HPC_DDP_STALL_MIN_S": "3", "STALL_RANK": "0", "STALL_HOW": "wait"},
                   timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-3000:]
    assert "rank 0: no step completed for" in out and "the run's only rank is alive but its loop made no progress" in out
    assert time.monotonic() - started < 120
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    stalled = [e for e in events if e["event"] == "stalled"]
    assert len(stalled) == 1 and stalled[0]["step"] >= 20 and "only rank" in stalled[0]["reason"], events


@pytest.mark.slurm
def test_on_slurm_a_stopped_rank_on_the_second_node_is_named_with_its_host(slurm_conf, tmp_path):
    from .helpers import submit_json, wait_for_job

    shutil.copy(Path(__file__).with_name("stall_probe.py"), tmp_path)
    started = time.monotonic()
    # --max-restarts 0: one stall, named; a restart in place would stall again (tested in test_restart_in_place).
    job = submit_json("--partition", "debug", "--nodes", "2", "--max-restarts", "0", "--run-dir", "run",
                      "stall_probe.py", cwd=tmp_path,
                      env={"HPC_DDP_STALL_MIN_S": "3"})["job_id"]
    assert wait_for_job(job, timeout=240) == "FAILED"
    assert time.monotonic() - started < 200   # not the 600 s collective timeout
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    stalled = [e for e in events if e["event"] == "stalled"]
    assert len(stalled) == 1 and "rank 1 (hpcn2) stopped responding" in stalled[0]["reason"], events
    assert "rank 1 (hpcn2) stopped responding" in hpc_ddp("status", "run", cwd=tmp_path).stdout


def test_a_stopped_rank_0_which_holds_the_store_is_named_too(tmp_path):
    """Rank 0 holds the rendezvous store: when it is the one that stops, the others cannot ask the store who
    is gone; they say rank 0 does not answer, within the limit plus STORE_ANSWER_S."""
    shutil.copy(Path(__file__).with_name("stall_probe.py"), tmp_path)
    started = time.monotonic()
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "2", "--run-dir", "run", "stall_probe.py",
                   cwd=tmp_path, env={"HPC_DDP_STALL_MIN_S": "3", "STALL_RANK": "0"}, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 1 and "rank 0 (localhost) does not answer" in out, out[-3000:]
    assert time.monotonic() - started < 150
    # round 4 (issue 43): status classifies it as the stall it is, not as a rendezvous timeout (the others'
    # lines speak of the rendezvous store rank 0 holds)
    status = json.loads(hpc_ddp("status", "--json", "run", cwd=tmp_path).stdout)
    assert status["failure"]["kind"] == "stalled" and "rank 0 (localhost) does not answer" in status["failure"]["detail"]
