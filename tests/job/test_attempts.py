"""The requeue policy as a pure function of the events an attempt left behind."""

import json

import pytest

from hpc_ddp.job import attempts
from hpc_ddp.job.attempts import Attempt, Limits, attempts_from_events, decide_begin, decide_end
from hpc_ddp.slurm import jobview

LIMITS = Limits(max_requeues=2, max_preemptions=3)


def ended(n, cause, start=None, trained=True, rc=75):
    return Attempt(n, start, trainer=trained, exit_code=rc, cause=cause)


def test_first_attempt_runs():
    assert decide_begin([], None, LIMITS) == (True, "first attempt")


@pytest.mark.parametrize("previous,start,ok,reason", [
    ([ended(0, "preempted", None)], 10, True, "restart 1 after preempted"),
    ([ended(0, "completed", rc=0)], 64, False, "already completed"),
    ([ended(0, None, rc=1)], None, False, "failed (exit code 1)"),
    ([Attempt(0, None, trainer=False)], None, True, "restart 1 after killed"),  # not the job's fault
    ([Attempt(0, 5, trainer=True), Attempt(1, 5, trainer=True)], 5, True, "restart 2 after killed"),
    ([Attempt(0, None, started_at=0.0, ended_at=100.0)], None, True, "restart 1 after killed"),  # a user script
    ([ended(0, "preempted", None), ended(1, "preempted", 10)], 10, False, "no progress"),
    ([ended(0, "preempted", 0)], 0, False, "no progress"),
    ([ended(i, "preempted", i) for i in range(4)], 4, False, "preempted 4 times, more than max_preemptions=3"),
    ([ended(i, "time_limit", i) for i in range(3)], 3, False, "time limit 3 times, more than max_requeues=2"),
    ([ended(0, "time_limit", 0), ended(1, "preempted", 1), ended(2, "preempted", 2)], 3, True, "restart 3"),
])
def test_decide_begin(previous, start, ok, reason):
    got_ok, got_reason = decide_begin(previous, start, LIMITS)
    assert got_ok == ok and reason in got_reason


@pytest.mark.parametrize("history,rc,requeue,reason", [
    ([ended(0, "time_limit", 0)], 75, True, "time_limit: requeue 1 of at most 2"),
    ([ended(i, "time_limit", i) for i in range(3)], 75, False, "3 requeues would exceed max_requeues=2"),
    ([ended(0, "preempted", 0)], 75, True, "preempted: requeue 1 of at most 3"),
    ([ended(0, None, 0)], 75, True, "preempted"),
    ([ended(0, None, 0)], 0, False, "completed"),
    ([ended(0, None, 0)], 2, False, "failed with exit code 2"),
    ([ended(0, None, 0, trained=False)], 75, False, "before training started"),
])
def test_decide_end(history, rc, requeue, reason):
    got, why = decide_end(history, rc, LIMITS)
    assert got == requeue and reason in why


def test_attempts_from_events():
    events = [
        {"event": "attempt_start", "attempt": 0, "checkpoint_step": None},
        {"event": "start", "step": 0},
        {"event": "signal", "cause": "time_limit", "step": 12},
        {"event": "attempt_end", "attempt": 0, "exit_code": 75},
        {"event": "attempt_start", "attempt": 1, "checkpoint_step": 12},
        {"event": "resume", "step": 12},
    ]
    a0, a1 = attempts_from_events(events)
    assert (a0.ended_cause, a0.trained, a0.start_step) == ("time_limit", True, None)
    assert (a1.ended_cause, a1.trained, a1.start_step) == ("killed", True, 12)


def test_begin_and_end_record_everything(tmp_path):
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec

    spec = build_spec([Layer("c", {"max_preemptions": 1})], target=Target("script", "/t.py"), workdir="/", python="p")
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    (tmp_path / "checkpoints").mkdir()
    assert attempts.begin(tmp_path, 0, env={"SLURM_JOB_ID": "7"})[0]
    (tmp_path / "checkpoints" / "latest").write_text("step-000000005-r1\n")
    with open(tmp_path / "events.jsonl", "a") as fh:
        fh.write(json.dumps({"event": "start"}) + "\n" + json.dumps({"event": "signal", "cause": "preempted"}) + "\n")
    assert attempts.end(tmp_path, 0, 75, env={"SLURM_JOB_ID": "7"}) == (True, "preempted: requeue 1 of at most 1")
    assert attempts.begin(tmp_path, 1, env={"SLURM_JOB_ID": "7"})[0]  # resumes from step 5
    with open(tmp_path / "events.jsonl", "a") as fh:
        fh.write(json.dumps({"event": "resume", "step": 5}) + "\n")
    # killed from outside without an end record: the second preemption, more than max_preemptions=1
    ok, reason = attempts.begin(tmp_path, 2, env={"SLURM_JOB_ID": "7"})
    assert not ok and "preempted 2 times, more than max_preemptions=1" in reason
    records = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records[-4:]] == ["attempt_start", "attempt_end", "attempt_end", "gave_up"]
    assert records[-3]["cause"] == "killed" and records[-2]["cause"] == "not_admitted"
    assert attempts.begin(tmp_path, 0, env={"SLURM_JOB_ID": "8"})[0]  # a new job of the same run dir may run


def test_a_checkpointed_attempt_is_requeued_whatever_srun_reports(tmp_path):
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec

    spec = build_spec([Layer("c", {})], target=Target("trainer", "/j.toml"), workdir="/", python="p")
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    env = {"SLURM_JOB_ID": "9"}
    assert attempts.begin(tmp_path, 0, env=env)[0]
    with open(tmp_path / "events.jsonl", "a") as fh:
        for event in ({"event": "start"}, {"event": "signal", "cause": "time_limit"}, {"event": "requeue_requested"}):
            fh.write(json.dumps(event) + "\n")
    assert attempts.end(tmp_path, 0, 143, env=env) == (True, "time_limit: requeue 1 of at most 10")


# ---- a program signalled from outside is not a failed program (what Slurm shows; see attempts' docstring) ----

def _show(state, reason="None", restarts=0, preempt="None", name="job.sh"):
    """`scontrol show job` as the batch shell sees it at the attempt's end (the lines that matter)."""
    return (f"JobId=3 JobName={name}\n   UserId=root(0) GroupId=root(0) MCS_label=N/A\n"
            f"   JobState={state} Reason={reason} Dependency=(null)\n"
            f"   Requeue=1 Restarts={restarts} BatchFlag=1 Reboot=0 ExitCode=0:0\n"
            f"   PreemptEligibleTime=2026-11-23T12:47:55 PreemptTime={preempt}\n"
            f"   Command=/x/job.sh\n   WorkDir=/x\n   StdOut=/x/out Restarts=7\n")


SHOW_JOB = {  # measured on Slurm 22.05 (see the attempts module docstring)
    "preempt_no_grace": _show("COMPLETING", restarts=1),
    "preempt_grace": _show("RUNNING", preempt="2026-11-23T12:47:59"),
    "admin_requeue": _show("COMPLETING", restarts=1),
    "time_limit": _show("COMPLETING", reason="TimeLimit"),
    "scancel": _show("COMPLETING"),
    "own_crash": _show("RUNNING"),
    # A job name or path that poses as Slurm's fields is not read as them.
    "own_crash_odd_name": _show("RUNNING", name="a Restarts=5 PreemptTime=2026-01-01T00:00:00"),
}


@pytest.mark.parametrize("case,shell_signal,cause,by_slurm", [
    ("preempt_no_grace", "TERM", "preempted", True),
    ("preempt_grace", None, "preempted", False),     # the step got SIGTERM, the batch shell did not
    ("admin_requeue", "TERM", "preempted", True),
    ("time_limit", None, "time_limit", False),
    ("scancel", "TERM", "cancelled", False),
    ("own_crash", None, "failed", False),
    ("own_crash_odd_name", None, "failed", False),
])
def test_outside_cause_from_slurm(case, shell_signal, cause, by_slurm):
    job = attempts.parse_show_job(SHOW_JOB[case])
    assert attempts.outside_cause(job, 0, shell_signal) == (cause, by_slurm)


def test_outside_cause_without_slurm_trusts_the_shell_signal():
    assert attempts.outside_cause(None, 0, "TERM") == ("preempted", False)
    assert attempts.outside_cause(None, 0, None) == ("failed", False)
    # A later attempt: Restarts counts every requeue, so only a count past this attempt's number means "again".
    assert attempts.outside_cause(attempts.parse_show_job(_show("RUNNING", restarts=2)), 2, None) == ("failed", False)


@pytest.mark.parametrize("history,rc,requeue,reason", [
    ([ended(0, "preempted", trained=False, rc=143)], 143, True, "preempted: requeue 1 of at most 3"),
    ([ended(i, "preempted", rc=143) for i in range(4)], 143, False, "4 requeues would exceed max_preemptions=3"),
    ([ended(0, "time_limit", rc=143)], 143, True, "time_limit: requeue 1 of at most 2"),
    ([ended(0, "cancelled", rc=143)], 143, False, "cancelled"),
    ([ended(0, "failed", rc=143)], 143, False, "failed with exit code 143"),
])
def test_decide_end_outside(history, rc, requeue, reason):
    got, why = decide_end(history, rc, LIMITS)
    assert got == requeue and reason in why


@pytest.mark.parametrize("previous,ok,reason", [
    ([ended(0, "preempted", 5, rc=143)], True, "restart 1 after preempted"),  # no checkpoint moved: not its fault
    ([ended(0, "cancelled", rc=143)], False, "cancelled"),
    ([ended(0, "failed", rc=143)], False, "failed (exit code 143)"),
])
def test_decide_begin_after_outside_end(previous, ok, reason):
    got_ok, got_reason = decide_begin(previous, 5, LIMITS)
    assert got_ok == ok and reason in got_reason


def _spec_dir(tmp_path, **keys):
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec

    spec = build_spec([Layer("c", keys)], target=Target("script", "/t.py"), workdir="/", python="p")
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    return tmp_path


@pytest.mark.parametrize("case,shell_signal,word,cause", [
    ("preempt_no_grace", "TERM", "requeued", "preempted"),
    ("preempt_grace", "", "requeue", "preempted"),
    ("scancel", "TERM", "stop", "cancelled"),
    ("own_crash", "", "stop", "failed"),
])
def test_finish_asks_slurm_and_records_the_cause(tmp_path, case, shell_signal, word, cause):
    run_dir = _spec_dir(tmp_path)
    env = {"SLURM_JOB_ID": "3", "HPC_DDP_SHELL_SIGNAL": shell_signal}
    assert attempts.begin(run_dir, 0, env=env)[0]
    asked = []
    outcome = attempts.finish(run_dir, 0, 143, env, ask_slurm=lambda job: asked.append(job) or
                              attempts.parse_show_job(SHOW_JOB[case]))
    assert asked == ["3"] and outcome.word == word
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    end = next(r for r in records if r["event"] == "attempt_end")
    assert end["cause"] == cause and end["exit_code"] == 143
    # The next attempt of the same job is admitted after a preemption, refused after a cancel or crash.
    assert attempts.begin(run_dir, 1, env=env)[0] == (cause == "preempted")


@pytest.mark.parametrize("case,shell_signal,word,cause", [
    # Lightning catches SIGTERM ("Bypassing SIGTERM") and leaves with exit 0 (issue 27): interrupted
    ("preempt_no_grace", "TERM", "requeued", "preempted"),   # GraceTime 0: Slurm requeues it, once
    ("preempt_grace", "", "requeue", "preempted"),           # GraceTime > 0, Slurm 22.05-23.11: we requeue
    ("admin_requeue", "TERM", "requeued", "preempted"),
    ("time_limit", "", "requeue", "time_limit"),
    ("scancel", "TERM", "stop", "cancelled"),                # scancel stays cancelled
    ("own_crash", "", "stop", "completed"),                  # Slurm shows no stop: the run is done
])
def test_exit_0_after_a_stop_is_an_interruption_not_a_completion(tmp_path, case, shell_signal, word, cause):
    run_dir = _spec_dir(tmp_path)
    env = {"SLURM_JOB_ID": "3", "HPC_DDP_SHELL_SIGNAL": shell_signal}
    assert attempts.begin(run_dir, 0, env=env)[0]
    outcome = attempts.finish(run_dir, 0, 0, env, ask_slurm=lambda job: attempts.parse_show_job(SHOW_JOB[case]))
    assert outcome.word == word
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    end = next(r for r in records if r["event"] == "attempt_end")
    assert (end["cause"], end["exit_code"]) == (cause, 0)
    assert ("interrupted, not completed" in end.get("note", "")) == (cause in ("preempted", "time_limit", "cancelled"))
    # The next attempt runs after an interruption (GraceTime 0 no longer meets "already completed"), not after
    # a completion or a cancel.
    ok, reason = attempts.begin(run_dir, 1, env=env)
    assert ok == (cause in ("preempted", "time_limit")), reason


@pytest.mark.parametrize("exit_code", [0, 143])
def test_a_rehearsed_preemption_on_slurm_counts_as_one_however_the_program_leaves(tmp_path, exit_code):
    """`hpc-ddp preempt --signal TERM` of a Slurm run (issue 54's newcomer, Lightning 2.6 on the test Slurm):
    Lightning caught the SIGTERM and left with exit 0 at epoch 58 of 99, Slurm showed nothing, and the run
    was recorded COMPLETED. The rehearsal is recorded before the signal; the attempt it reached is preempted."""
    run_dir = _spec_dir(tmp_path)
    env = {"SLURM_JOB_ID": "3", "HPC_DDP_SHELL_SIGNAL": ""}
    assert attempts.begin(run_dir, 0, env=env)[0]
    (run_dir / "events.jsonl").open("a").write(json.dumps({"event": "preempt_rehearsed", "signal": "TERM"}) + "\n")
    outcome = attempts.finish(run_dir, 0, exit_code, env,
                              ask_slurm=lambda job: attempts.parse_show_job(SHOW_JOB["own_crash"]))
    assert outcome.word == "requeue", outcome.reason
    end = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
           if json.loads(line)["event"] == "attempt_end"][-1]
    assert end["cause"] == "preempted" and "rehearsed preemption" in end["note"], end
    assert attempts.begin(run_dir, 1, env=env)[0]
    # the next attempt is not rehearsed: its own exit 0 completes the run
    assert attempts.finish(run_dir, 1, 0, env, ask_slurm=lambda job: attempts.parse_show_job(
        SHOW_JOB["own_crash"])).word == "stop"


@pytest.mark.parametrize("warned,word,cause", [(True, "requeue", "time_limit"), (False, "stop", "completed")])
def test_exit_0_after_the_warning_reached_the_programs_handler_is_a_time_limit(tmp_path, warned, word, cause):
    """A script that handles the warning itself, saves and exits 0 before Slurm shows anything: the rank
    recorded "warned" (exitsite/hpc_ddp_warned.py); without that record, an exit 0 is a completion."""
    run_dir = _spec_dir(tmp_path)
    env = {"SLURM_JOB_ID": "3", "HPC_DDP_SHELL_SIGNAL": ""}
    assert attempts.begin(run_dir, 0, env=env)[0]
    if warned:
        (run_dir / "events.jsonl").open("a").write(json.dumps({"event": "warned", "signal": "USR2"}) + "\n")
    outcome = attempts.finish(run_dir, 0, 0, env, ask_slurm=lambda job: attempts.parse_show_job(SHOW_JOB["own_crash"]))
    assert outcome.word == word
    end = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
           if json.loads(line)["event"] == "attempt_end"][-1]
    assert end["cause"] == cause
    if warned:
        assert "the time-limit warning reached its handler" in end["note"]


def test_a_run_that_checkpointed_at_a_scancel_is_cancelled_not_requeued(tmp_path):
    """The trainer or a Session checkpoints at any SIGTERM and exits 75; under scancel Slurm shows the job
    cancelled, and a requeue would fail on it (and the fallback queue a job nobody asked for)."""
    run_dir = _spec_dir(tmp_path)
    env = {"SLURM_JOB_ID": "3", "HPC_DDP_SHELL_SIGNAL": "TERM"}
    assert attempts.begin(run_dir, 0, env=env)[0]
    with open(run_dir / "events.jsonl", "a") as fh:
        for event in ({"event": "start"}, {"event": "signal", "cause": "preempted"}, {"event": "requeue_requested"}):
            fh.write(json.dumps(event) + "\n")
    outcome = attempts.finish(run_dir, 0, 75, env, ask_slurm=lambda job: attempts.parse_show_job(SHOW_JOB["scancel"]))
    assert outcome.word == "stop"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["cause"] for e in events if e["event"] == "attempt_end"] == ["cancelled"]
    # a preemption of the same run is still run again
    for case, word in (("preempt_grace", "requeue"), ("preempt_no_grace", "requeued")):
        (tmp_path / case).mkdir()
        other = _spec_dir(tmp_path / case)
        assert attempts.begin(other, 0, env=env)[0]
        with open(other / "events.jsonl", "a") as fh:
            fh.write(json.dumps({"event": "start"}) + "\n" + json.dumps({"event": "requeue_requested"}) + "\n")
        got = attempts.finish(other, 0, 75, env, ask_slurm=lambda job, c=case: attempts.parse_show_job(SHOW_JOB[c]))
        assert got.word == word, case


def test_a_recorded_finish_is_a_completion_whatever_came_after(tmp_path):
    run_dir = _spec_dir(tmp_path)
    env = {"SLURM_JOB_ID": "3", "HPC_DDP_SHELL_SIGNAL": "TERM"}
    assert attempts.begin(run_dir, 0, env=env)[0]
    (run_dir / "events.jsonl").open("a").write(json.dumps({"event": "finish", "step": 80}) + "\n")
    asked = []
    outcome = attempts.finish(run_dir, 0, 0, env, ask_slurm=lambda job: asked.append(job) or
                              attempts.parse_show_job(SHOW_JOB["preempt_grace"]))
    assert outcome.word == "stop" and asked == []  # no need to ask
    assert attempts.finished_in_last_attempt(run_dir)


@pytest.mark.parametrize("deadline_in,cause", [(30.0, "time_limit"), (3600.0, "preempted")])
def test_without_slurm_a_stop_at_the_deadline_is_the_time_limit(tmp_path, deadline_in, cause):
    """The local and srun executors: no scontrol answer; a SIGTERM near the deadline is the limit's."""
    import time

    run_dir = _spec_dir(tmp_path)
    env = {"HPC_DDP_JOB_ID": "local-1", "HPC_DDP_SHELL_SIGNAL": "TERM",
           "HPC_DDP_DEADLINE": f"{time.time() + deadline_in:.3f}"}
    assert attempts.begin(run_dir, 0, env=env)[0]
    outcome = attempts.finish(run_dir, 0, 0, env, ask_slurm=_no_slurm)
    assert outcome.requeue
    end = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()][-2]
    assert end["event"] == "attempt_end" and end["cause"] == cause


def test_a_user_script_preempted_over_and_over_stops_at_the_cap(tmp_path):
    run_dir = _spec_dir(tmp_path, max_preemptions=2)
    env = {"SLURM_JOB_ID": "11"}
    for n in range(3):
        assert attempts.begin(run_dir, n, env=env)[0]
        show = _show("RUNNING", restarts=n, preempt="2026-11-23T12:47:59")
        outcome = attempts.finish(run_dir, n, 143, env, ask_slurm=lambda _job, s=show: attempts.parse_show_job(s))
        assert outcome.requeue == (n < 2), outcome
    assert "more than max_preemptions=2" in outcome.reason or "exceed max_preemptions=2" in outcome.reason


# ---- chains: one run carried on by several Slurm jobs (--chain, the requeue fallback) ----

def _events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _link(run_dir, job_id, chain, previous, via="requeue_fallback"):
    with open(run_dir / "submissions.jsonl", "a") as fh:
        fh.write(json.dumps({"executor": "sbatch", "job_id": job_id, "chain": chain, "previous": previous,
                             "via": via}) + "\n")


def _trained_and_checkpointed(run_dir, cause="preempted", step=None):
    with open(run_dir / "events.jsonl", "a") as fh:
        fh.writelines(json.dumps(event) + "\n" for event in (
            {"event": "start"}, {"event": "signal", "cause": cause}, {"event": "requeue_requested"}))
    if step is not None:
        (run_dir / "checkpoints").mkdir(exist_ok=True)
        (run_dir / "checkpoints" / "latest").write_text(f"step-{step:09d}\n")


def _no_slurm(_job):
    return None


def test_attempts_from_events_follows_a_chain_across_job_ids():
    events = [
        {"event": "attempt_start", "attempt": 0, "job_id": "5"},
        {"event": "attempt_end", "attempt": 0, "exit_code": 75, "cause": "time_limit"},
        {"event": "requeue", "attempt": 0, "by": "chain", "next_job": "6"},
        {"event": "attempt_start", "attempt": 0, "job_id": "6", "chain": "5"},
        {"event": "attempt_end", "attempt": 0, "exit_code": 75, "cause": "preempted"},
        {"event": "gave_up", "attempt": 0, "reason": "enough"},
    ]
    first, second = attempts_from_events(events, "5")
    assert (first.job_id, first.handed_over, second.job_id, second.gave_up) == ("5", True, "6", "enough")
    assert attempts_from_events(events, "6") == []  # job 6 is no chain of its own: its chain is 5's
    assert len(attempts_from_events(events)) == 2


def test_a_handed_over_time_limit_counts_against_no_cap():
    over = Attempt(0, 0, trainer=True, exit_code=75, cause="time_limit", handed_over=True)
    assert decide_begin([over] * 5, 5, LIMITS) == (True, "restart 5 after time_limit")
    assert decide_end([over, ended(1, "time_limit", 1)], 75, LIMITS) == (True, "time_limit: requeue 1 of at most 2")
    # A handover after a preemption is still a preemption.
    assert decide_end([ended(i, "preempted", i) for i in range(4)], 75, LIMITS, successor="9")[0] is False
    assert decide_end([ended(0, "time_limit", 0)] * 3, 75, LIMITS, successor="9") == \
        (True, "time_limit: job 9, queued after this one, goes on")


@pytest.mark.parametrize("previous,verdict", [
    ([], None),
    ([ended(0, "completed", rc=0)], ("done", "the run already completed in an earlier job of the chain")),
    ([Attempt(0, 3, exit_code=75, cause="preempted", job_id="5", gave_up="preempted: 4 requeues would exceed")],
     ("stop", "the run stopped in job 5: preempted: 4 requeues would exceed")),
    ([ended(0, "preempted", 3)], None),
])
def test_decide_successor(previous, verdict):
    got = attempts.decide_successor(previous)
    assert got == verdict if verdict is None else got[0] == verdict[0] and verdict[1] in got[1]


def test_a_fallback_job_goes_on_with_the_chains_caps(tmp_path):
    """Job 5 is preempted once (cap 1), its requeue is refused, the fallback job 6 carries on: its first
    attempt is the chain's second, and a second preemption there is over the cap."""
    run_dir = _spec_dir(tmp_path, max_preemptions=1)
    env5, env6 = {"SLURM_JOB_ID": "5"}, {"SLURM_JOB_ID": "6"}
    assert attempts.begin(run_dir, 0, env=env5)[0]
    _trained_and_checkpointed(run_dir, step=10)
    assert attempts.finish(run_dir, 0, 75, env5, ask_slurm=_no_slurm).word == "requeue"
    queued = []
    assert attempts.resubmit(run_dir, 0, "Requested operation is presently disabled for job 5", env5,
                             queue=lambda *args: queued.append(args) or "6") == "6"
    assert queued == [(run_dir, "5", "5", env5)]
    _link(run_dir, "6", "5", "5")
    fallback = _events(run_dir)[-1]
    assert fallback["event"] == "requeue_fallback" and fallback["next_job"] == "6" and "disabled" in fallback["why"]
    admission = attempts.admit(run_dir, 0, env6)
    assert admission.ok and admission.reason == "restart 1 after preempted"
    assert _events(run_dir)[-1]["chain"] == "5"
    _trained_and_checkpointed(run_dir, step=20)
    outcome = attempts.finish(run_dir, 0, 75, env6, ask_slurm=_no_slurm)
    assert outcome.word == "stop" and "2 requeues would exceed max_preemptions=1" in outcome.reason
    # A new submission of the run dir is a new chain: the caps start afresh.
    assert attempts.begin(run_dir, 0, env={"SLURM_JOB_ID": "7"}) == (True, "first attempt")


def test_a_later_job_of_a_chain_ends_at_once_when_the_run_completed(tmp_path):
    run_dir = _spec_dir(tmp_path)
    _link(run_dir, "6", "5", "5", via="chain")
    assert attempts.begin(run_dir, 0, env={"SLURM_JOB_ID": "5"})[0]
    assert attempts.finish(run_dir, 0, 0, {"SLURM_JOB_ID": "5"}, ask_slurm=_no_slurm).word == "stop"
    admission = attempts.admit(run_dir, 0, {"SLURM_JOB_ID": "6"})
    assert (admission.ok, admission.done, admission.exit_code) == (False, True, attempts.RUN_COMPLETE_EXIT_CODE)
    assert "already completed in job 5" in admission.reason
    skipped = _events(run_dir)[-1]
    assert skipped["event"] == "skipped" and skipped["job_id"] == "6"
    assert not any(e["event"] == "attempt_start" and e.get("job_id") == "6" for e in _events(run_dir))


def test_a_later_job_of_a_chain_does_not_run_after_the_policy_stopped(tmp_path):
    run_dir = _spec_dir(tmp_path)
    _link(run_dir, "6", "5", "5", via="chain")
    _link(run_dir, "7", "5", "6", via="chain")
    env5 = {"SLURM_JOB_ID": "5"}
    assert attempts.begin(run_dir, 0, env=env5)[0]
    with open(run_dir / "events.jsonl", "a") as fh:  # asked to be requeued before training: the crash loop guard
        fh.write(json.dumps({"event": "requeue_requested"}) + "\n")
    assert attempts.finish(run_dir, 0, 75, env5, ask_slurm=lambda job: {"JobState": "PENDING"}).word == "stop"
    for job in ("6", "7"):  # each refuses in turn, and says why
        admission = attempts.admit(run_dir, 0, {"SLURM_JOB_ID": job})
        assert admission.exit_code == attempts.NOT_ADMITTED_EXIT_CODE and "crash loop guard" in admission.reason


@pytest.mark.parametrize("state,word", [("PENDING", "next"), ("CANCELLED", "requeue"), (None, "next")])
def test_a_time_limit_hands_over_to_the_next_queued_job(tmp_path, state, word):
    run_dir = _spec_dir(tmp_path, max_requeues=0)
    _link(run_dir, "6", "5", "5", via="chain")
    env5 = {"SLURM_JOB_ID": "5"}
    assert attempts.begin(run_dir, 0, env=env5)[0]
    _trained_and_checkpointed(run_dir, cause="time_limit", step=10)
    asked = []

    def ask(job):
        asked.append(job)
        return None if job == "5" or state is None else {"JobState": state}

    outcome = attempts.finish(run_dir, 0, 75, env5, ask_slurm=ask)
    assert asked == ["5", "6"] and outcome.word == (word if word == "next" else "stop")  # max_requeues=0
    if word == "next":
        assert outcome.next_job == "6" and outcome.reason == "time_limit: job 6, queued after this one, goes on"
        assert _events(run_dir)[-1] == {**_events(run_dir)[-1], "event": "requeue", "by": "chain", "next_job": "6"}
        # Job 6 starts (max_requeues=0 does not stop it: the chain is what was asked for) and resumes.
        assert attempts.admit(run_dir, 0, {"SLURM_JOB_ID": "6"}).reason == "restart 1 after time_limit"


def test_resubmit_that_fails_too_gives_up_and_says_how_to_go_on(tmp_path):
    from hpc_ddp.common.errors import SubmitError

    run_dir = _spec_dir(tmp_path)

    def refuse(*_args):
        raise SubmitError("sbatch not found")

    with pytest.raises(SubmitError, match=r"queueing the next attempt as a new job failed too: sbatch not found") as info:
        attempts.resubmit(run_dir, 2, "scontrol: command not found", {"SLURM_JOB_ID": "5"}, queue=refuse)
    assert f"cd {run_dir} && sbatch job.sbatch" in info.value.hint
    assert _events(run_dir)[-1]["event"] == "gave_up" and "scontrol: command not found" in _events(run_dir)[-1]["reason"]


def test_main_resubmit_and_the_complete_exit_code(tmp_path, monkeypatch, capsys):
    run_dir = _spec_dir(tmp_path)
    _link(run_dir, "6", "5", "5", via="chain")
    monkeypatch.setenv("SLURM_JOB_ID", "5")
    monkeypatch.setattr(attempts, "slurm_job", _no_slurm)
    assert attempts.main(["begin", str(run_dir), "0"]) == 0
    assert attempts.main(["end", str(run_dir), "0", "0"]) == 0
    monkeypatch.setenv("SLURM_JOB_ID", "6")
    assert attempts.main(["begin", str(run_dir), "0"]) == attempts.RUN_COMPLETE_EXIT_CODE
    assert attempts.main(["resubmit", str(run_dir)]) == 2  # usage
    monkeypatch.delenv("SLURM_JOB_ID")
    assert attempts.main(["resubmit", str(run_dir), "0", "no scontrol"]) == 1
    assert "not inside a Slurm job" in capsys.readouterr().err


def test_a_chain_cancelled_before_it_ran_does_not_take_the_run_up_again(tmp_path):
    run_dir = _spec_dir(tmp_path)
    _link(run_dir, "6", "5", "5", via="chain")
    with open(run_dir / "events.jsonl", "a") as fh:  # `hpc-ddp cancel 5` while job 5 was still pending
        fh.write(json.dumps({"event": "cancelled", "job_id": "5", "by": "hpc-ddp cancel"}) + "\n")
    admission = attempts.admit(run_dir, 0, {"SLURM_JOB_ID": "6"})
    assert not admission.ok and admission.reason == "job 5 of the chain was cancelled (hpc-ddp cancel)"
    assert attempts.begin(run_dir, 0, env={"SLURM_JOB_ID": "9"})[0]  # a new submission is a new chain


# ---- a lost node (issue 32) ----

@pytest.mark.parametrize("state, lost", [("down", True), ("down*", True), ("idle*", False), ("mixed*", False),
                                         ("fail", True), ("failing", True), ("idle", False), ("allocated", False),
                                         ("mixed", False), ("drained", False), ("completing", False),
                                         ("down~", True), ("mixed+drain", False)])
def test_lost_states(state, lost):
    assert attempts.lost_state(state) is lost


def test_down_nodes_asks_sinfo_for_the_jobs_nodes(monkeypatch):
    import subprocess

    monkeypatch.setattr(jobview.shutil, "which", lambda name: "/usr/bin/" + name)
    asked = []

    def sinfo(argv, **_):
        asked.append(argv)
        return subprocess.CompletedProcess(argv, 0, "hpcn1|allocated\nhpcn2|down*\nhpcn2|down*\nhpcn3|idle*\n", "")
    assert attempts.down_nodes("hpcn[1-3]", run=sinfo) == ["hpcn2"]   # hpcn3 only misses pings
    assert attempts.down_nodes("hpcn[1-3]", run=sinfo, silent=True) == ["hpcn2", "hpcn3"]
    del asked[1:]
    assert asked == [["sinfo", "-h", "-N", "-n", "hpcn[1-3]", "-o", "%N|%T"]]
    assert attempts.down_nodes(None, run=sinfo) == []
    assert attempts.down_nodes("hpcn1", run=lambda argv, **_: subprocess.CompletedProcess(argv, 1, "", "x")) == []


def test_an_attempt_that_lost_a_node_is_requeued_within_max_requeues(tmp_path, monkeypatch):
    run_dir = _spec_dir(tmp_path, max_requeues=1)
    monkeypatch.setattr(attempts, "down_nodes", lambda nodes, run=None, silent=False: ["hpcn2"] if nodes else [])
    env = {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "hpcn[1-2]"}
    for attempt, word in ((0, "requeue"), (1, "stop")):   # one requeue: max_requeues=1
        assert attempts.begin(run_dir, attempt, env=env)[0]
        with open(run_dir / "events.jsonl", "a") as fh:   # it trained; its ranks then vanished with the node
            fh.write(json.dumps({"event": "start"}) + "\n")
        outcome = attempts.finish(run_dir, attempt, 137, env, ask_slurm=lambda job: attempts.parse_show_job(
            SHOW_JOB["own_crash"]))
        assert outcome.word == word, outcome.reason
    records = _events(run_dir)
    ends = [r for r in records if r["event"] == "attempt_end" and r.get("cause") == "node_failure"]
    assert len(ends) == 2 and ends[0]["nodes"] == "hpcn2" and "went down" in ends[0]["note"]
    assert "node_failure: 2 requeues would exceed max_requeues=1" in records[-1]["reason"]


def test_a_batch_shell_that_went_down_with_its_node_is_recorded_at_the_next_begin(tmp_path, monkeypatch):
    run_dir = _spec_dir(tmp_path)
    monkeypatch.setattr(attempts, "down_nodes", lambda nodes, run=None, silent=False: ["hpcn1"] if nodes == "hpcn1" else [])
    assert attempts.begin(run_dir, 0, env={"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "hpcn1"})[0]
    ok, reason = attempts.begin(run_dir, 1, env={"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "hpcn2"})
    assert ok and "node_failure" in reason
    lost = [r for r in _events(run_dir) if r.get("cause") == "node_failure"]
    assert lost and lost[0]["attempt"] == 0 and lost[0]["nodes"] == "hpcn1"


def _sacct(lines):
    from hpc_ddp.common.procs import Completed, FakeCommands

    return FakeCommands({"sacct": lambda argv: Completed(tuple(argv), 0, "".join(f"{line}\n" for line in lines), "")},
                        installed=("sacct",))


def test_accounted_end_is_the_state_of_the_latest_run_that_ended(monkeypatch):
    monkeypatch.undo()  # the real one (tests/job/conftest.py fakes it), asking a fake sacct
    fields = "|0:0|00:00:41|2026-11-28T05:00:00|2026-11-28T05:00:41|hpcn[1-2]|None"
    from hpc_ddp.job.attempts import accounted_end

    commands = _sacct([f"12|PREEMPTED{fields}", f"12|RUNNING{fields}"])
    assert accounted_end("12", commands) == "PREEMPTED"
    assert "-D" in commands.calls[0][0] and "12" in commands.calls[0][0]
    assert accounted_end("12", _sacct([f"12|TIMEOUT{fields}"])) == "TIMEOUT"  # a chain's earlier job: ended
    assert accounted_end("12", _sacct([f"12|RUNNING{fields}"])) is None        # not yet accounted
    assert accounted_end("12", _sacct([f"12|NODE_FAIL{fields}", f"12|CANCELLED by 0{fields}",
                                       f"12|PENDING{fields}"])) == "CANCELLED"
    assert accounted_end("12", _sacct([])) is None and accounted_end(None, _sacct([])) is None
    from hpc_ddp.common.procs import FakeCommands

    assert accounted_end("12", FakeCommands(installed=())) is None              # no sacct on the node


@pytest.mark.parametrize("state,cause", [("PREEMPTED", "preempted"), ("TIMEOUT", "time_limit"),
                                         ("NODE_FAIL", "node_failure"), ("REQUEUED", "killed"), (None, "killed")])
def test_an_attempt_without_an_end_record_takes_its_cause_from_slurms_accounting(tmp_path, monkeypatch, state, cause):
    """Slurm SIGKILLed the batch shell (a program that outlived GraceTime, as Lightning's handler can):
    the next begin records the cause accounting gives, and the caps count it as such."""
    run_dir = _spec_dir(tmp_path, max_preemptions=1)
    asked = []
    monkeypatch.setattr(attempts, "accounted_end", lambda job_id, commands=None: asked.append(job_id) or state)
    env = {"SLURM_JOB_ID": "9"}
    assert attempts.begin(run_dir, 0, env=env)[0]
    assert attempts.begin(run_dir, 1, env=env)[0]
    end = [r for r in _events(run_dir) if r["event"] == "attempt_end"]
    assert asked == ["9"] and [(r["attempt"], r["cause"]) for r in end] == [(0, cause)]
    assert (f"accounting says {state}" in end[0]["note"]) if state else ("accounting" not in end[0]["note"])
    previous = attempts_from_events(_events(run_dir))
    assert previous[0].ended_cause == cause
    # a second one: the preemption cap (1) counts preempted and killed alike; the others have their own
    ok, reason = attempts.begin(run_dir, 2, env=env)
    assert ok == (cause not in ("preempted", "killed")), reason


# ---- Slurm 24.05 and later requeue a job preempted in its GraceTime themselves (slurm.jobview) ----

def _preempted_and_checkpointed(run_dir):
    """What the trainer or a Session records when a stop reached it: it trained, checkpointed, asked for a requeue."""
    with (run_dir / "events.jsonl").open("a") as fh:
        for record in ({"event": "start", "step": 0}, {"event": "signal", "cause": "preempted"},
                       {"event": "requeue_requested", "exit_code": 75}):
            fh.write(json.dumps(record) + "\n")

def test_a_grace_preemption_that_slurm_requeues_itself_is_not_requeued_again(tmp_path):
    """Slurm 24.11 (tests/slurm/answers/24.11): the step was preempted in its GraceTime and the program
    checkpointed (exit 75). Slurm requeues the job once the batch script ends; a `scontrol requeue` of ours
    on top would leave its grace flag set and the completed next run would be requeued once more."""
    run_dir = _spec_dir(tmp_path)
    env = {"SLURM_JOB_ID": "3", "HPC_DDP_SHELL_SIGNAL": ""}
    assert attempts.begin(run_dir, 0, env=env)[0]
    _preempted_and_checkpointed(run_dir)
    asked = []
    outcome = attempts.finish(run_dir, 0, 75, env, ask_slurm=lambda job: attempts.parse_show_job(SHOW_JOB["preempt_grace"]),
                              grace_requeue=lambda job, attempt, env: asked.append((job["JobState"], attempt)) or True)
    assert outcome.word == "requeued" and asked == [("RUNNING", 0)]
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [r.get("by") for r in records if r["event"] == "requeue"] == ["slurm"]


def test_slurm_is_asked_who_requeues_only_for_a_grace_preemption(monkeypatch):
    monkeypatch.undo()  # the real one, with Slurm's answers faked below
    calls = []
    monkeypatch.setattr(attempts, "slurm_version", lambda: calls.append("version") or (24, 11))
    monkeypatch.setattr(attempts, "preempt_mode", lambda partition: calls.append(partition) or "REQUEUE")
    grace = {**attempts.parse_show_job(SHOW_JOB["preempt_grace"]), "Partition": "grace"}
    assert attempts.slurm_requeues_after_grace(grace, 0, {})
    assert calls == ["version", "grace"]
    calls.clear()
    for case in ("preempt_no_grace", "own_crash", "time_limit", "scancel"):
        assert not attempts.slurm_requeues_after_grace(attempts.parse_show_job(SHOW_JOB[case]), 0, {})
    assert calls == []
    monkeypatch.setattr(attempts, "slurm_version", lambda: (23, 11))
    assert not attempts.slurm_requeues_after_grace(grace, 0, {})


def test_a_completed_run_started_once_more_by_slurm_ends_completed_not_failed(tmp_path):
    """Slurm 24.11 started a job once more after its run completed (issue 51): that start is skipped, the
    batch script exits 0 (RUN_COMPLETE), and it is no attempt: `status` counts one restart, not two."""
    run_dir = _spec_dir(tmp_path)
    env = {"SLURM_JOB_ID": "3", "HPC_DDP_SHELL_SIGNAL": ""}
    assert attempts.begin(run_dir, 0, env=env)[0]
    _preempted_and_checkpointed(run_dir)
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "latest").write_text("step-4")
    attempts.finish(run_dir, 0, 75, env, ask_slurm=lambda job: attempts.parse_show_job(SHOW_JOB["preempt_grace"]))
    assert attempts.begin(run_dir, 1, env=env)[0]
    (run_dir / "events.jsonl").open("a").write(json.dumps({"event": "finish", "step": 9}) + "\n")
    assert attempts.finish(run_dir, 1, 0, env, ask_slurm=lambda job: None).word == "stop"  # the run completed
    admission = attempts.admit(run_dir, 2, env=env)
    assert not admission.ok and admission.done and admission.exit_code == attempts.RUN_COMPLETE_EXIT_CODE
    assert "the run completed in attempt 1" in admission.reason
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [r["attempt"] for r in records if r["event"] == "attempt_start"] == [0, 1]
    assert records[-1]["event"] == "skipped" and records[-1]["attempt"] == 2
    assert not any(r["event"] == "gave_up" for r in records)
    assert len(attempts_from_events(records)) == 2
    assert attempts.main(["begin", str(run_dir), "3"]) == attempts.RUN_COMPLETE_EXIT_CODE


def test_the_other_ranks_go_by_rank_0s_admission(tmp_path):
    """The submitit executor runs `admit` on rank 0 only: the other ranks read its decision, so none starts a
    program rank 0 will not join (they would wait for it in init_process_group)."""
    run_dir = _spec_dir(tmp_path)
    env = {"SLURM_JOB_ID": "3", "HPC_DDP_SHELL_SIGNAL": ""}
    assert attempts.admission_of(run_dir, 0, "3", timeout=0.3, poll=0.05) is None   # rank 0 has not decided
    assert attempts.begin(run_dir, 0, env=env)[0]
    assert attempts.admission_of(run_dir, 0, "3", timeout=2, poll=0.05).ok
    (run_dir / "events.jsonl").open("a").write(json.dumps({"event": "finish", "step": 3}) + "\n")
    attempts.finish(run_dir, 0, 0, env, ask_slurm=lambda job: None)
    attempts.admit(run_dir, 1, env=env)   # the run completed: skipped
    skipped = attempts.admission_of(run_dir, 1, "3", timeout=2, poll=0.05)
    assert not skipped.ok and skipped.done
    (run_dir / "events.jsonl").open("a").write(json.dumps({"event": "skipped", "job_id": "8", "chain": "3",
                                                           "reason": "the run already completed in job 3"}) + "\n")
    assert attempts.admission_of(run_dir, 0, "8", timeout=2, poll=0.05).done   # a chain's next job
    other = _spec_dir(tmp_path / "o") if (tmp_path / "o").mkdir() is None else None
    assert attempts.begin(other, 0, env=env)[0]
    attempts.finish(other, 0, 1, env, ask_slurm=lambda job: attempts.parse_show_job(SHOW_JOB["own_crash"]))
    assert not attempts.begin(other, 1, env=env)[0]   # failed before: refused, recorded with gave_up
    refused = attempts.admission_of(other, 1, "3", timeout=2, poll=0.05)
    assert not refused.ok and not refused.done and "failed" in refused.reason


@pytest.mark.parametrize("argv", [["begin", "R", "zero"], ["end", "R", "0", "12:00"], ["end", "R", "1e3", "0"],
                                  ["begin", "R", "٣"], ["end", "R", "0", "9" * 400]])
def test_damaged_numbers_on_the_command_line_are_one_line_and_exit_2(tmp_path, argv, capsys):
    argv = [a.replace("R", str(tmp_path)) if a == "R" else a for a in argv]
    assert attempts.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "must be whole numbers" in err and "HINT:" in err
    assert not (tmp_path / "events.jsonl").exists()


def test_records_that_are_json_but_not_objects_are_left_out(tmp_path):
    run_dir = _spec_dir(tmp_path)
    (run_dir / "events.jsonl").write_text('[1, 2]\n"text"\n3\nnull\n{"event": "snapshot"}\n')
    env = {"SLURM_JOB_ID": "3", "HPC_DDP_SHELL_SIGNAL": ""}
    assert attempts.begin(run_dir, 0, env=env)[0]
    assert attempts.finish(run_dir, 0, 0, env, ask_slurm=lambda job: None).word == "stop"


def test_no_fallback_job_where_the_requeue_went_through_after_all(tmp_path):
    """22.05, seen in the GraceTime loop: `scontrol requeue` requeued the job, and the requeue's SIGTERM to
    the batch shell killed scontrol before it answered ("failed: no message"). A fallback job on top would
    have run the run twice; Slurm's Restarts past the attempt says it was requeued."""
    run_dir = _spec_dir(tmp_path)
    queued = []
    got = attempts.resubmit(run_dir, 0, "no message", {"SLURM_JOB_ID": "7"},
                            queue=lambda *a: queued.append(a) or "9",
                            ask_slurm=lambda job: attempts.parse_show_job(_show("COMPLETING", restarts=1)))
    assert got is None and queued == [] and not (run_dir / "events.jsonl").exists()
    assert attempts.resubmit(run_dir, 0, "no message", {"SLURM_JOB_ID": "7"}, queue=lambda *a: "9",
                             ask_slurm=lambda job: attempts.parse_show_job(_show("RUNNING"))) == "9"
