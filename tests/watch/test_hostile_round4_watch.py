"""Hardening round 4 (issue 43), what status, sweep status and rerun make of what a run left: a rank 0
that hangs is 'stalled', not a rendezvous timeout; NaN and inf are no best metric; a rank log of any size
is read from its end, never whole; and the local executor refuses a size it cannot start before planning a
process per rank."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest

from hpc_ddp.debug import rerun as rr
from hpc_ddp.launch.sweep import best_metric
from hpc_ddp.watch.classify import classify_failure

STALL_RANK0 = ("hpc-ddp: error: rank 1: no step completed for 62 s (the limit is 60 s: 10 x the 0.50 s step, at "
               "least 60 s); rank 0 on node1 does not answer (it holds the rendezvous store): it died or hung; "
               "ending the attempt")
STALL_ANY = ("hpc-ddp: error: rank 0: no step completed for 61 s (the limit is 60 s: 10 x the 0.10 s step, at least "
             "60 s); every rank still answers, so one may be deadlocked; ending the attempt")


@pytest.mark.parametrize("line", [STALL_RANK0, STALL_ANY], ids=["rank 0 hangs", "a deadlock"])
def test_a_rank_that_hangs_mid_training_is_stalled_not_a_rendezvous_timeout(line):
    kind, detail = classify_failure([f"step 10\n{line}\n", "torch.distributed.DistNetworkError: TCPStore ... "
                                                          "rendezvous\n"])
    assert kind == "stalled" and "no step completed" in detail


def test_a_long_step_that_went_on_is_not_the_failure():
    """The stall watch's warning for a step that was only slow (a starved rank on a loaded machine) must
    not hide what did fail: here a rank on another node that stopped responding."""
    went_on = ("hpc-ddp: warning: rank 0: no step completed for 16 s (the limit is 15 s), then the run went on: "
               "not a stall\n")
    lost = "hpc-ddp train: error: rank 0: rank 3 (hpcn2) stopped responding (no heartbeat for 5 s): it died or hung\n"
    assert classify_failure([went_on, lost]) == ("rank_lost", lost.strip())
    assert classify_failure([went_on]) is None


def test_a_real_rendezvous_timeout_is_still_one():
    assert classify_failure(["torch.distributed.DistNetworkError: timed out after 600 s in the rendezvous\n"])[0] \
        == "rendezvous_timeout"


METRICS = [
    ([{"loss": math.nan, "step": 1}, {"loss": 0.5, "step": 2}, {"loss": 0.7, "step": 3}], None, 0.5),
    ([{"loss": 0.5, "step": 1}, {"loss": math.nan, "step": 2}], None, 0.5),
    ([{"val_acc": math.inf, "step": 1}, {"val_acc": 0.9, "step": 2}], "val_acc:max", 0.9),
    ([{"loss": -math.inf}, {"loss": 2}], None, 2),
    ([{"loss": math.nan}], None, None),
    ([[1], "x", None, {"loss": True}, {"loss": "0.1"}, {"loss": 10 ** 400}], None, 10 ** 400),
]


@pytest.mark.parametrize(("metrics", "wanted", "best"), METRICS)
def test_nan_and_inf_are_never_the_best_metric(metrics, wanted, best):
    found = best_metric(metrics, wanted)
    assert (found["value"] if found else None) == best


def test_a_huge_rank_log_is_read_from_its_end(tmp_path):
    log = tmp_path / "logs" / "job-1" / "attempt-0" / "rank-0.log"
    log.parent.mkdir(parents=True)
    with open(log, "wb") as fh:  # 3 GB of nothing, then the traceback: a sparse file, no disk used
        fh.seek(3 << 30)
        fh.write(b"\nTraceback (most recent call last):\n  File \"t.py\", line 1\nValueError: boom\n")
    started = time.monotonic()
    assert rr.attempt_failure(tmp_path, "1", 0) == "ValueError: boom"
    assert time.monotonic() - started < 5


def test_a_fifo_rank_log_is_skipped_by_rerun(tmp_path):
    log = tmp_path / "logs" / "job-1" / "attempt-0" / "rank-0.log"
    log.parent.mkdir(parents=True)
    os.mkfifo(log)
    assert rr.attempt_failure(tmp_path, "1", 0) is None


@pytest.mark.parametrize("nodes", ["1-100000", "5000", "257"])
def test_the_local_executor_refuses_more_ranks_than_it_starts_before_planning_them(tmp_path, nodes):
    (tmp_path / "t.py").write_text("print(1)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--dry-run", "--executor", "local", "--nodes",
                           nodes, "t.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "more than the 256 it starts" in done.stderr and "HINT" in done.stderr
    assert time.monotonic() - started < 30 and not done.stdout


def test_the_local_executor_plans_256_ranks(tmp_path):
    from hpc_ddp.launch.executors.local import MAX_RANKS, refuse_too_many_ranks
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec

    spec = build_spec([Layer("t", {"nodes": 32, "tasks_per_node": 8})], target=Target("script", "t.py"),
                      workdir=str(tmp_path), python=sys.executable)
    assert spec.most_nodes * spec.tasks_per_node == MAX_RANKS
    refuse_too_many_ranks(spec)


def test_provenance_of_a_repo_with_no_commits_is_said_whole():
    from hpc_ddp.watch.status import code_line

    line = code_line("abc", {"abc": {"git": True, "commit": None, "branch": "master", "dirty": False}})
    assert "git no commits yet on master, clean" in line
    assert "git 0123456789ab on main" in code_line("x", {"x": {"git": True, "commit": "0123456789abcdef",
                                                               "branch": "main", "dirty": False}})


# ---- events that are not records of ours: left out by the one reader (events.well_formed), never a crash ----

BASE_EVENTS = [{"event": "attempt_start", "attempt": 0, "job_id": "local-1-1", "checkpoint_step": None, "time": 1000.0},
               {"event": "start", "step": 0, "time": 1001.0},
               {"event": "attempt_end", "attempt": 0, "exit_code": 1, "cause": "failed", "time": 1010.0}]
HOSTILE_EVENTS = {
    "attempt None": (0, "attempt", None), "attempt a string": (0, "attempt", "x"),
    "checkpoint_step a list": (0, "checkpoint_step", []), "checkpoint_step a string": (0, "checkpoint_step", "x"),
    "end's attempt None": (2, "attempt", None),
}
SHAPES = {"a list": [1], "a string": "s", "null": None, "a nested list": [[]]}


def _hostile_run(tmp_path, events):
    import json

    spec = {"target": {"kind": "script", "value": "t.py", "args": []}, "job_name": "t", "workdir": str(tmp_path),
            "python": sys.executable, "executor": "local"}
    run = tmp_path / "run"
    run.mkdir()
    (run / "spec.json").write_text(json.dumps(spec))
    (run / "submissions.jsonl").write_text(json.dumps({"job_id": "local-1-1", "executor": "local"}) + "\n")
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


@pytest.mark.parametrize("case", sorted(HOSTILE_EVENTS) + sorted(SHAPES))
def test_events_of_the_wrong_types_or_shapes_are_no_internal_error(tmp_path, case):
    events = [dict(e) for e in BASE_EVENTS]
    if case in HOSTILE_EVENTS:
        index, key, value = HOSTILE_EVENTS[case]
        events[index][key] = value
    else:
        events.append(SHAPES[case])
    run = _hostile_run(tmp_path, events)
    env = {**os.environ, "HPC_DDP_REGISTRY": str(tmp_path / "runs.jsonl")}
    for command in (["status"], ["rerun", "--dry-run"]):
        done = subprocess.run([sys.executable, "-m", "hpc_ddp", *command, str(run)], capture_output=True, text=True,
                              timeout=120, env=env)
        assert done.returncode in (0, 1, 2) and "internal error" not in done.stderr, (command, done.stderr)
        assert "Traceback" not in done.stderr


def test_status_names_the_stall_watchs_record_as_the_failure(tmp_path):
    from hpc_ddp.watch.status import _failure

    reason = "rank 0 on node1 does not answer (it holds the rendezvous store): it died or hung"
    events = [{"event": "attempt_start", "attempt": 0, "job_id": "1", "time": 1.0},
              {"event": "stalled", "seconds": 62.0, "limit": 60.0, "reason": reason, "step": 9, "time": 2.0}]
    log = tmp_path / "logs" / "job-1" / "attempt-0" / "rank-0.log"
    log.parent.mkdir(parents=True)
    log.write_text("torch.distributed.DistNetworkError: TCPStore timed out in the rendezvous\n")
    assert _failure(tmp_path, events) == {"kind": "stalled", "detail": reason}
    earlier = [events[1], {"event": "attempt_start", "attempt": 1, "job_id": "1", "time": 3.0}]
    assert _failure(tmp_path, earlier) is None or _failure(tmp_path, earlier)["kind"] != "stalled"
