"""checkpoint_every_minutes = "auto" (issue 44): Young's interval, its inputs (the run's history, sacct, the
prior) and its clamps, pure; then the Session choosing it, recording why, and choosing again once a save is
measured."""

import json
import math
import subprocess

import pytest
import torch

from hpc_ddp.job.distenv import from_environ
from hpc_ddp.trainer import interval
from hpc_ddp.trainer.interval import Evidence, choose, from_history, from_sacct, parse_sacct, young
from hpc_ddp.trainer.session import Session, UsageError


def test_young():
    assert young(5.0, 1 / 86400) == pytest.approx(math.sqrt(2 * 5 * 86400))


def test_the_prior_alone_one_interruption_per_24_node_hours():
    record = choose(save_s=2.0, nodes=4, evidence=[])
    rate_s = 4 / (24 * 3600)
    assert record["seconds"] == pytest.approx(math.sqrt(2 * 2.0 / rate_s), abs=0.1)
    assert record["rate_per_node_hour"] == pytest.approx(1 / 24, rel=1e-4)
    assert record["save_measured"] and record["clamped"] is None
    assert record["sources"]["prior"] == {"interruptions": 1.0, "node_hours": 24.0,
                                          "note": "one interruption per 24 node-hours"}
    assert record["why"].startswith("Young: sqrt(2 x 2 s save / 0.167 interruptions/h (4 nodes x 0.0417/node-h))")


def test_history_and_sacct_add_to_the_prior():
    history = Evidence("history", 3, 12.0)
    sacct = Evidence("sacct", 10, 1000.0)
    record = choose(save_s=None, nodes=2, evidence=[history, sacct])
    assert record["rate_per_node_hour"] == pytest.approx((1 + 3 + 10) / (24 + 12 + 1000), rel=1e-4)
    assert record["save_s"] == interval.DEFAULT_SAVE_S and not record["save_measured"]
    assert "(estimate)" in record["why"] and set(record["sources"]) == {"prior", "history", "sacct"}


def test_clamps():
    fast = choose(save_s=0.001, nodes=1000, evidence=[Evidence("history", 100, 1.0)])
    assert fast["seconds"] == interval.MIN_S and "at least" in fast["clamped"]
    slow_save = choose(save_s=30.0, nodes=1000, evidence=[Evidence("history", 100, 1.0)])
    assert slow_save["seconds"] == 300.0   # 10 x the save
    short = choose(save_s=5.0, nodes=1, evidence=[], time_left_s=120.0)
    assert short["seconds"] == 120.0 and short["clamped"] == "at most the time the job has left"


def _events(*records):
    return [dict(r) for r in records]


def test_the_runs_history_counts_interruptions_over_node_hours():
    events = _events(
        {"event": "attempt_start", "attempt": 1, "job_id": "7", "nodes": "n[1-4]", "time": 0.0},
        {"event": "attempt_end", "attempt": 1, "exit_code": 143, "cause": "preempted", "time": 3600.0},
        {"event": "attempt_start", "attempt": 2, "job_id": "7", "nodes": "n[1-2]", "time": 4000.0},
        {"event": "signal", "cause": "time_limit", "time": 5700.0},
        {"event": "requeue_requested", "time": 5790.0},
        {"event": "attempt_end", "attempt": 2, "exit_code": 75, "cause": "time_limit", "time": 5800.0},
        {"event": "attempt_start", "attempt": 3, "job_id": "7", "nodes": "n1", "time": 6000.0},  # killed: no end
        {"event": "attempt_start", "attempt": 4, "job_id": "7", "nodes": "n[1-4]", "time": 7800.0},  # now
    )
    found = from_history(events, nodes=4, now=8000.0)
    assert found.interruptions == 2   # the preemption and the kill; the time limit saved at its stop
    assert found.node_hours == pytest.approx(4 * 1.0 + 2 * 0.5 + 1 * 0.5)


def test_sacct_output_is_parsed_and_its_failures_are_said():
    text = "COMPLETED|2|3600\nPREEMPTED|4|1800\nNODE_FAIL|1|600\nCANCELLED by 5|1|60\nRUNNING|1|bad\n"
    found = parse_sacct(text, "debug")
    assert (found.interruptions, round(found.node_hours, 4)) == (2, round(2 + 2 + 600 / 3600 + 60 / 3600, 4))

    def missing(*_a, **_k):
        raise FileNotFoundError("sacct")

    def slow(*_a, **_k):
        raise subprocess.TimeoutExpired("sacct", 10)

    def failing(*_a, **_k):
        return subprocess.CompletedProcess([], 1, "", "sacct: error: Slurm accounting storage is disabled\n")

    asked = []

    def fine(command, **kwargs):
        asked.append((command, kwargs["timeout"]))
        return subprocess.CompletedProcess(command, 0, text, "")

    assert "sacct not found" in from_sacct("debug", run=missing).note
    assert "did not answer in 10 s" in from_sacct("debug", run=slow).note
    assert "accounting storage is disabled" in from_sacct("debug", run=failing).note
    assert from_sacct("debug", run=fine).interruptions == 2
    assert asked[0][1] == interval.SACCT_TIMEOUT_S and ["-r", "debug"] == asked[0][0][5:7]
    assert from_sacct(None).note.startswith("no partition")


def test_a_sacct_that_shows_only_the_users_own_jobs_says_so():
    """PrivateData=jobs: sacct -a shows a user their own jobs only (the same format, fewer lines)."""
    mine = "COMPLETED|2|3600|ana\nPREEMPTED|4|1800|ana\n"
    assert "yours only" in parse_sacct(mine, "gpu", me="ana").note
    assert "yours only" not in parse_sacct(mine + "COMPLETED|1|60|ben\n", "gpu", me="ana").note
    assert "yours only" not in parse_sacct(mine, "gpu", me="ben").note
    assert "yours only" not in parse_sacct("", "gpu", me="ana").note
    seen = from_sacct("gpu", run=lambda command, **kw: subprocess.CompletedProcess(command, 0, mine, ""), me="ana")
    assert (seen.interruptions, seen.note) == (1, "partition gpu, 2 jobs in 7 days (yours only: the site may hide "
                                                  "others' jobs, PrivateData=jobs)")


def test_a_session_with_auto_chooses_records_and_chooses_again_once_a_save_is_measured(tmp_path, capsys):
    run = Session(tmp_path, env=from_environ({}, pid=1), checkpoint_every_minutes="auto").setup()
    try:
        first = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        chosen = [e for e in first if e["event"] == "checkpoint_interval"]
        assert len(chosen) == 1 and not chosen[0]["save_measured"]
        assert chosen[0]["sources"]["sacct"]["note"] == "not a Slurm job: not asked"
        assert run.checkpoint_every_minutes == pytest.approx(chosen[0]["seconds"] / 60)
        run.track(model=torch.nn.Linear(2, 1))
        run.save()
        run.step(1.0)
        records = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
        again = [e for e in records if e["event"] == "checkpoint_interval"]
        assert len(again) == 2 and again[1]["save_measured"] and again[1]["save_s"] < 5
    finally:
        run.close()
    assert 'checkpoint every' in capsys.readouterr().err


def test_another_word_is_refused(tmp_path):
    with pytest.raises(UsageError, match="neither minutes nor"):
        Session(tmp_path, env=from_environ({}, pid=1), checkpoint_every_minutes="often")


def test_the_train_table_takes_auto_or_minutes():
    from hpc_ddp.spec.trainconfig import parse_train

    assert parse_train({"checkpoint_every_minutes": "auto"}).checkpoint_every_minutes == "auto"
    assert parse_train({"checkpoint_every_minutes": 5}).checkpoint_every_minutes == 5.0
    assert parse_train({}).checkpoint_every_minutes == 30.0   # not the default: see docs/preemption.md
    with pytest.raises(ValueError, match='checkpoint_every_minutes: .often. is not a number .minutes, or "auto"'):
        parse_train({"checkpoint_every_minutes": "often"})


def test_a_damaged_hostlist_in_the_history_counts_as_the_jobs_own_nodes():
    """Issue 53: a record whose nodes are `n[1-20000000]` (or not a hostlist) is neither expanded nor fatal."""
    from hpc_ddp.trainer.interval import _node_count

    assert _node_count("n[1-20000000]", 4) == 4 and _node_count("n[", 2) == 2 and _node_count("n[1-3]", 9) == 3


@pytest.mark.parametrize(("start", "end"), [(0.0, 1e308), (-1e308, 1e308), ("0", "3600"), (0.0, float("nan")),
                                            (10 ** 400, 3600.0), (0.0, -(10 ** 400)),
                                            (True, 3600.0), (5000.0, 1000.0), (0.0, 400 * 86400.0), (0.0, 1e12)])
def test_a_damaged_attempt_in_the_history_is_left_out_and_said(start, end):
    """Issue 53: one record spanning +-1e308 s, or with string times, killed every "auto" run at rank 0's
    start (ZeroDivisionError, TypeError). Each is left out now, the note says so, and the interval is the
    prior's and the good attempt's."""
    good = ({"event": "attempt_start", "attempt": 1, "job_id": "7", "nodes": "n1", "time": 0.0},
            {"event": "attempt_end", "attempt": 1, "exit_code": 143, "cause": "preempted", "time": 3600.0})
    bad = ({"event": "attempt_start", "attempt": 2, "job_id": "7", "nodes": "n1", "time": start},
           {"event": "attempt_end", "attempt": 2, "exit_code": 143, "cause": "preempted", "time": end})
    found = from_history(_events(*good, *bad), nodes=1, now=2e6)
    assert (found.interruptions, found.node_hours) == (1, pytest.approx(1.0))
    assert found.note == "2 attempts; 1 damaged attempt left out"
    record = choose(save_s=5.0, nodes=1, evidence=[found])
    assert math.isfinite(record["seconds"]) and record["seconds"] <= interval.MAX_S
    json.dumps(record, allow_nan=False)  # a record hpc-ddp writes, whole


def test_sacct_lines_no_job_could_have_are_left_out_and_said():
    """Issue 53: ElapsedRaw 1e17, a negative or zero NNodes, a 400-digit number and non-UTF-8 bytes (read with
    errors=replace) were summed in (node_hours -29.98) or raised in the sacct thread."""
    lines = ["COMPLETED|2|3600", "PREEMPTED|1|7200", "COMPLETED|1|100000000000000000", "COMPLETED|-3|3600",
             "COMPLETED|0|3600", "COMPLETED|" + "9" * 400 + "|60", "COMPLETED|2|1e5", "COMPLETED|\ufffd|60",
             "COMPLETED|200000|60", ""]
    found = parse_sacct("\n".join(lines), "gpu")
    assert (found.interruptions, found.node_hours) == (1, pytest.approx(4.0))
    assert found.note == "partition gpu, 2 jobs in 7 days; 7 damaged lines left out"


def test_a_quiet_history_never_stretches_the_interval_past_six_hours():
    """Issue 53: one in-range record of a long clean attempt drove the interval to 82 days."""
    quiet = Evidence("history", 0, 300 * 24 * 1000.0)
    record = choose(save_s=30.0, nodes=1, evidence=[quiet])
    assert record["seconds"] == interval.MAX_S and record["clamped"] == "at most 6 h"
    assert record["young_s"] > interval.MAX_S  # what Young alone would have said, still recorded


def test_sacct_is_read_with_undecodable_bytes_replaced():
    seen = {}

    def run(command, **kwargs):
        seen.update(kwargs)
        return subprocess.CompletedProcess(command, 0, "PREEMPTED|1|3600\n", "")

    assert from_sacct("gpu", run=run).interruptions == 1 and seen.get("errors") == "replace"
