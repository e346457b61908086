"""Live progress and time accounting from the CLI: the ETA's arithmetic, `status` (its time line, a
damaged last record, --watch) and `timeline` (its PNG, and bad input as one line, exit 2)."""

import json

import pytest
from click.testing import CliRunner
from test_timeline import T0, preempted_run

from hpc_ddp.cli import cli
from hpc_ddp.watch.status import estimate_eta, eta_text, recent_step_seconds

NOW = T0 + 1000


def test_eta_without_a_time_limit_is_steps_left_times_step_time():
    eta = estimate_eta(step=100, total_steps=400, step_seconds=2.0, now=NOW, attempt_started=NOW - 50,
                       time_limit_s=None)
    assert (eta.seconds, eta.more_attempts, eta.fits) == (600, 0, True)


def test_eta_within_this_attempt():
    eta = estimate_eta(step=100, total_steps=400, step_seconds=2.0, now=NOW, attempt_started=NOW - 100,
                       time_limit_s=3600, signal_lead_s=120, requeues_left=3)
    assert (eta.seconds, eta.more_attempts, eta.fits) == (600, 0, True)


def test_eta_counts_the_requeues_the_time_limit_forces():
    # 3000 s of work; this attempt has 1000 - 100 - 500 = 400 s left to train; each later attempt trains
    # 1000 - 100 (lead) - 50 (restart) = 850 s: 2600 s more need 4 attempts, the last training 50 s.
    eta = estimate_eta(step=0, total_steps=3000, step_seconds=1.0, now=NOW, attempt_started=NOW - 500,
                       time_limit_s=1000, signal_lead_s=100, restart_s=50, queue_s=30, requeues_left=5)
    assert eta.more_attempts == 4 and eta.fits
    assert eta.seconds == pytest.approx(500 + 3 * (1000 + 30) + 30 + 50 + 50)
    assert "after 4 more requeue(s) at the time limit (5 allowed)" in eta_text(eta.__dict__, NOW)


def test_eta_says_when_the_allowed_requeues_are_not_enough():
    eta = estimate_eta(step=0, total_steps=3000, step_seconds=1.0, now=NOW, attempt_started=NOW - 500,
                       time_limit_s=1000, signal_lead_s=100, restart_s=50, requeues_left=1)
    assert not eta.fits
    assert eta_text(eta.__dict__, NOW) == ("will not finish: needs 4 more requeue(s) after time limits, "
                                           "max_requeues leaves 1")
    never = estimate_eta(step=0, total_steps=10, step_seconds=100.0, now=NOW, attempt_started=NOW,
                         time_limit_s=100, signal_lead_s=60, restart_s=60)
    assert never.seconds is None and "will not finish" in eta_text(never.__dict__, NOW)


def test_no_eta_without_a_step_time_or_total():
    assert estimate_eta(step=5, total_steps=None, step_seconds=1.0, now=NOW, attempt_started=NOW,
                        time_limit_s=None) is None
    assert estimate_eta(step=5, total_steps=10, step_seconds=None, now=NOW, attempt_started=NOW,
                        time_limit_s=None) is None


def test_recent_step_time_ignores_eval_records():
    metrics = [{"time": 10.0, "step": 10, "loss": 1}, {"time": 20.0, "step": 20, "loss": 1},
               {"time": 90.0, "step": 20, "eval_acc": 0.5}]
    assert recent_step_seconds(metrics) == 1.0


# ---- the CLI ----

def write_run(path, events, metrics, spec=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "spec.json").write_text(json.dumps(spec or {}))
    (path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (path / "submissions.jsonl").write_text(json.dumps({"executor": "sbatch", "job_id": "7", "time": T0}) + "\n")
    return path


@pytest.fixture
def run(tmp_path, monkeypatch):
    # Slurm's commands know nothing of job 7: status reads the records alone.
    bin_dir = tmp_path / "noslurm"
    bin_dir.mkdir()
    for name in ("squeue", "sacct", "scontrol"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    events, metrics = preempted_run()
    return write_run(tmp_path / "run", events, metrics)


def invoke(*args):
    return CliRunner().invoke(cli, list(args))


def test_status_prints_where_the_time_went(run):
    result = invoke("status", str(run))
    assert result.exit_code == 0, result.output
    assert ("time used        85% of 4 min allocated time trained, 3 min queued; 1 preemption cost 40 s "
            "(20 s restarting, 20 s redoing 20 steps)") in result.output.splitlines()
    info = json.loads(invoke("status", "--json", str(run)).output)
    assert info["time_used"].startswith("85% of") and info["eta"] is None  # completed: no ETA


def test_a_damaged_last_line_never_stops_status(run):
    with open(run / "events.jsonl", "a") as fh:
        fh.write('{"time": 1800000500.0, "event": "attem')  # killed mid-write
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write('[1, 2]\n{"time": 18000')
    result = invoke("status", str(run))
    assert result.exit_code == 0, result.output
    assert "COMPLETED" in result.output and "step 200/200" in result.output and "time used        85%" in result.output


def test_status_watch_prints_progress_until_the_job_ends(tmp_path, monkeypatch):
    """A fake squeue says RUNNING twice, then nothing (the job ended): one progress line per poll."""
    events, metrics = preempted_run()
    run = write_run(tmp_path / "run", events[:9], metrics[:15], {"time": 3600, "signal_lead": 120,
                                                                   "max_requeues": 2})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    count = tmp_path / "polls"
    (bin_dir / "squeue").write_text(f"#!/bin/bash\necho x >> {count}\n"
                                    f"[ $(wc -l < {count}) -le 2 ] && echo 'RUNNING|None'\nexit 0\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    result = invoke("status", "--watch", "--interval", "0.2", str(run))
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "RUNNING" in line and "step" in line]
    assert len(lines) == 2
    assert "step 130/200 (65%)" in lines[0] and "600 samples/s" in lines[0] and "ETA " in lines[0]
    assert result.output.splitlines()[-1].startswith("last event")  # then the full status, once


def test_timeline_writes_a_png_and_prints_the_summary(run):
    import matplotlib.image as mpimg

    result = invoke("timeline", str(run))
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == [
        "85% of 4 min allocated time trained, 3 min queued; 1 preemption cost 40 s (20 s restarting, "
        "20 s redoing 20 steps)", f"Wrote {run / 'timeline.png'}"]
    img = mpimg.imread(run / "timeline.png")
    assert img.shape[0] > 400 and img[..., :3].std() > 0.05


@pytest.mark.parametrize("setup,args,message", [
    ("empty", [], "has no attempt or training records yet"),
    ("truncated", [], "has no attempt or training records yet"),
    ("run", ["-o", "/proc/x.png"], "is not a directory you can write to"),
    ("run", ["-o", "nodir/x.png"], "is not a directory you can write to"),
    ("run", ["-o", "."], "is a directory"),
])
def test_timeline_bad_input_is_one_line_exit_2(run, tmp_path, monkeypatch, setup, args, message):
    monkeypatch.chdir(tmp_path)
    target = run
    if setup == "empty":
        target = write_run(tmp_path / "empty", [], [])
    elif setup == "truncated":
        target = write_run(tmp_path / "trunc", [], [])
        (target / "events.jsonl").write_text('{"time": 1800000000.0, "event": "attempt_st')
    result = invoke("timeline", *args, str(target))
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) <= 2 and message in result.output
    assert "Traceback" not in result.output


def test_timeline_that_cannot_be_written_is_one_line(run, monkeypatch):
    """The run dir passed the checks but the write fails (read-only mount, quota): one line, exit 2."""
    import hpc_ddp.watch.timeline

    def refuse(fig, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(hpc_ddp.watch.timeline, "save_png", refuse)
    result = invoke("timeline", str(run))
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        f"hpc-ddp: error: cannot write {str(run / 'timeline.png')!r}: Permission denied"]


# ---- Slurm accounting (sacct) in status and list, against recorded output ----

SACCT = ("7|PREEMPTED|0:15|00:02:00|2027-01-15T08:01:00|2027-01-15T08:03:00|hpcn[1-2]|None\n"
         "7|COMPLETED|0:0|00:02:19|2027-01-15T08:05:01|2027-01-15T08:07:20|hpcn[1-2]|None\n"
         "8|CANCELLED by 0|0:0|00:00:00|None|2027-01-15T08:09:00|None assigned|None\n"
         "9.batch|COMPLETED|0:0|00:00:01|x|y|hpcn1|None\n"
         "garbage line\n")


def test_parse_sacct_keeps_every_run_of_a_requeued_job():
    from hpc_ddp.slurm.jobstate import parse_sacct

    jobs = parse_sacct(SACCT)
    assert set(jobs) == {"7", "8"}
    assert [r["state"] for r in jobs["7"]] == ["PREEMPTED", "COMPLETED"]
    assert jobs["8"][0]["state"] == "CANCELLED" and jobs["7"][1]["elapsed"] == "00:02:19"


def test_status_takes_state_elapsed_exit_and_requeues_from_sacct(run):
    from hpc_ddp.common.procs import Completed, FakeCommands
    from hpc_ddp.watch.status import format_status, run_status

    fake = FakeCommands({"squeue": lambda a: Completed(tuple(a), 0, "", ""),
                         "sacct": lambda a: Completed(tuple(a), 0, "\n".join(SACCT.splitlines()[:2]) + "\n", "")},
                        installed=("squeue", "sacct", "scontrol"))
    info = run_status(run, "7", "sbatch", fake)
    assert info["scheduler"]["source"] == "sacct" and info["state"] == "COMPLETED"
    assert [h["state"] for h in info["scheduler"]["history"]] == ["PREEMPTED", "COMPLETED"]
    lines = list(format_status(info))
    assert "slurm accounting COMPLETED, elapsed 00:02:19, exit code 0:0" in lines
    assert "slurm runs       PREEMPTED 00:02:00 on hpcn[1-2] -> COMPLETED 00:02:19 on hpcn[1-2]" in lines
    assert any(call[0][:2] == ("sacct", "-n") and "-D" in call[0] for call in fake.calls)


def test_list_shows_state_and_elapsed_from_sacct(tmp_path, monkeypatch):
    registry = tmp_path / "runs.jsonl"
    registry.write_text("".join(json.dumps({"time": T0, "job_id": j, "executor": e, "run_dir": f"/r/{j}",
                                            "name": f"n{j}"}) + "\n" for j, e in (("7", "sbatch"), ("8", "sbatch"),
                                                                                   ("local-1-2", "local"))))
    monkeypatch.setenv("HPC_DDP_REGISTRY", str(registry))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text(f"#!/bin/sh\necho \"$*\" > {tmp_path}/args\ncat <<'X'\n{SACCT}X\n")
    (bin_dir / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    result = invoke("list")
    assert result.exit_code == 0, result.output
    rows = [line.split() for line in result.output.splitlines()]
    assert rows[0] == ["JOB", "EXECUTOR", "STATE", "ELAPSED", "NAME", "RUN", "DIR"]
    assert rows[1][:4] == ["7", "sbatch", "COMPLETED", "00:02:19"]
    assert rows[2][:4] == ["8", "sbatch", "CANCELLED", "00:00:00"]
    assert rows[3][:4] == ["local-1-2", "local", "-", "-"]  # its run dir is gone: nothing says how it ended
    assert "-j 7,8 " in (tmp_path / "args").read_text()  # one call for all of them, local runs left out
    out = json.loads(invoke("list", "--json").output)
    assert out[0]["slurm"] == {"state": "COMPLETED", "elapsed": "00:02:19", "exit_code": "0:0"}


@pytest.mark.parametrize("command", ["status", "timeline"])
def test_a_records_file_that_cannot_be_read_is_one_line(run, command):
    (run / "events.jsonl").unlink()
    (run / "events.jsonl").mkdir()  # hostile or broken: a directory in its place
    result = invoke(command, str(run))
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        f"hpc-ddp: error: cannot read {str(run / 'events.jsonl')!r}: Is a directory"]


def test_eta_of_an_attempt_still_restarting_counts_the_rest_of_its_start_up():
    eta = estimate_eta(step=40, total_steps=100, step_seconds=0.5, now=NOW, attempt_started=NOW - 2,
                       time_limit_s=None, startup_left_s=7)
    assert eta.seconds == 7 + 30
    tight = estimate_eta(step=40, total_steps=100, step_seconds=1.0, now=NOW, attempt_started=NOW - 2,
                         time_limit_s=100, signal_lead_s=10, restart_s=20, startup_left_s=30, requeues_left=3)
    # 100 - 10 - 2 - 30 = 58 s left to train here: 60 s of work needs one more attempt
    assert tight.more_attempts == 1


def test_status_names_the_job_of_each_attempt_when_a_run_spans_several_jobs():
    """Slurm numbers attempts per job: after a chain's second job starts, `attempt 0` alone would be ambiguous."""
    from hpc_ddp.watch.status import format_status

    base = {"scheduler": None, "job_id": "12", "executor": "sbatch", "state": "COMPLETED", "run_dir": "/r",
            "step": None, "last_checkpoint_step": 40, "restarts": 2, "resumes": [], "gave_up": None,
            "failure": None, "last_event": None}
    attempts = [{"attempt": 0, "start_step": None, "ended": "time_limit", "exit_code": 75, "job_id": "11"},
                {"attempt": 1, "start_step": 20, "ended": "time_limit", "exit_code": 75, "job_id": "11"},
                {"attempt": 0, "start_step": 40, "ended": "completed", "exit_code": 0, "job_id": "12"}]
    lines = list(format_status({**base, "attempts": attempts}))
    assert "  attempt 1 of job 11: started at checkpoint step 20, ended: time_limit (exit code 75)" in lines
    assert "  attempt 0 of job 12: started at checkpoint step 40, ended: completed" in lines
    one_job = [{**a, "job_id": "11"} for a in attempts[:2]]
    assert "  attempt 1: started at checkpoint step 20, ended: time_limit (exit code 75)" in list(
        format_status({**base, "attempts": one_job}))


def test_list_shows_how_a_finished_local_run_ended(tmp_path, monkeypatch):
    """Issue 42, item 15: a local run's state is its run dir's record of the end, not '-'."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "submissions.jsonl").write_text(
        json.dumps({"executor": "local", "job_id": "local-1-2", "run_dir": str(run_dir), "state": "RUNNING"}) + "\n"
        + json.dumps({"executor": "local", "job_id": "local-1-2", "run_dir": str(run_dir), "state": "CANCELLED",
                      "returncode": 130}) + "\n")
    registry = tmp_path / "runs.jsonl"
    registry.write_text(json.dumps({"time": T0, "job_id": "local-1-2", "executor": "local", "run_dir": str(run_dir),
                                    "name": "n"}) + "\n")
    monkeypatch.setenv("HPC_DDP_REGISTRY", str(registry))
    result = invoke("list")
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[1].split()[:3] == ["local-1-2", "local", "CANCELLED"]


def test_the_restarts_line_counts_restarts_in_place_too(tmp_path):
    """Issue 53: `restarts 0` stood beside `restarted in place 1 time`."""
    from hpc_ddp.common.procs import FakeCommands
    from hpc_ddp.watch.status import format_status, run_status

    records = [{"time": T0, "event": "attempt_start", "attempt": 0, "job_id": "7", "nodes": "hpcn[1-2]"},
               {"time": T0 + 1, "event": "start", "step": 0},
               {"time": T0 + 50, "event": "restarted", "attempt": 0, "restart": 1, "cause": "failed",
                "nodes": "hpcn1,hpcn2", "node_count": 2, "checkpoint_step": 10, "seconds_lost": 5.0},
               {"time": T0 + 100, "event": "attempt_end", "attempt": 0, "exit_code": 0, "cause": "completed"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    lines = list(format_status(run_status(tmp_path, "7", "sbatch", FakeCommands({}, installed=()))))
    assert "restarts         0 requeued, 1 in place" in lines, lines


def test_a_script_that_reports_no_steps_is_not_measured_rather_than_0_percent(tmp_path):
    """Issue 54: a plain script's status read '0% of 11 s allocated time trained; goodput 0%'."""
    from hpc_ddp.common.procs import FakeCommands
    from hpc_ddp.watch.status import format_status, run_status

    records = [{"time": T0, "event": "attempt_start", "attempt": 0, "job_id": "7", "nodes": "hpcn[1-2]"},
               {"time": T0 + 11, "event": "attempt_end", "attempt": 0, "exit_code": 0, "cause": "completed"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    info = run_status(tmp_path, "7", "sbatch", FakeCommands({}, installed=()))
    text = "\n".join(format_status(info))
    assert "not measured: the script reports no steps" in text and "hpc_ddp.start()" in text
    assert "0%" not in text and "goodput  " not in text and info["goodput"] is None
