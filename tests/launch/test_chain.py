"""Jobs that wait for jobs: --after checked against Slurm, --chain N queued up front, doctor's requeue
mode, and the batch script's requeue fallback run for real in bash with fake srun/scontrol/sbatch."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.checks.preflight import read_slurm_config, requeue_mode
from hpc_ddp.common.errors import SubmitError, UserError
from hpc_ddp.common.procs import Completed, FakeCommands
from hpc_ddp.launch.executors.base import Plan, write_run_dir
from hpc_ddp.launch.executors.sbatch import SbatchExecutor, dependency_problem, job_state
from hpc_ddp.launch.render import render_sbatch
from hpc_ddp.spec.jobspec import Layer, Target, build_spec


def spec_of(values=None, python="/opt/venv/bin/python", workdir="/home/ada"):
    return build_spec([Layer("flags", values or {})], target=Target("script", "/home/ada/train.py"),
                      workdir=workdir, python=python)


def slurm(states=None, sbatch_fails_at=None, sacct=None):
    """Fake Slurm: `states` job id -> JobState for scontrol; sbatch hands out 100, 101, ..."""
    states = states or {}
    queued = []

    def scontrol(argv):
        job = argv[-1]
        if job in states:
            return Completed(tuple(argv), 0, f"JobId={job} JobName=x\n   JobState={states[job]} Reason=None\n")
        return Completed(tuple(argv), 1, "", "slurm_load_jobs error: Invalid job id specified")

    def sbatch(argv):
        if sbatch_fails_at is not None and len(queued) == sbatch_fails_at:
            return Completed(tuple(argv), 1, "", "sbatch: error: QOSMaxSubmitJobPerUserLimit")
        queued.append(argv)
        return Completed(tuple(argv), 0, f"{99 + len(queued)};cluster\n")

    handlers = {"scontrol": scontrol, "sbatch": sbatch}
    if sacct is not None:
        handlers["sacct"] = lambda argv: Completed(tuple(argv), 0, sacct)
    return FakeCommands(handlers, installed=tuple(handlers)), queued


def plan_in(tmp_path, values=None):
    spec = spec_of(values)
    run_dir = str(tmp_path / "run")
    return Plan("sbatch", spec, run_dir, render_sbatch(spec, run_dir, generated_at="", command_line=""), "")


def submissions(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "submissions.jsonl").read_text().splitlines()]


# ---- --chain ----

def test_a_chain_queues_n_jobs_each_after_the_one_before(tmp_path):
    commands, queued = slurm()
    seen = []
    sub = SbatchExecutor(commands).submit(plan_in(tmp_path, {"chain": 3}), on_job_id=seen.append)
    assert sub.job_ids == ("100", "101", "102") and sub.job_id == "100" and seen == ["100", "101", "102"]
    assert [tuple(argv[1:]) for argv in queued] == [("--parsable", "job.sbatch"),
                                             ("--parsable", "--dependency=afterany:100", "job.sbatch"),
                                             ("--parsable", "--dependency=afterany:101", "job.sbatch")]
    records = submissions(sub.run_dir)
    assert [(r["job_id"], r.get("chain"), r.get("previous"), r.get("via")) for r in records] == [
        ("100", None, None, None), ("101", "100", "100", "chain"), ("102", "100", "101", "chain")]
    assert json.loads(json.dumps(sub.to_json()))["job_ids"] == ["100", "101", "102"]


def test_a_chain_cut_short_by_sbatch_names_the_jobs_that_were_queued(tmp_path):
    commands, _ = slurm(sbatch_fails_at=2)
    with pytest.raises(SubmitError) as info:
        SbatchExecutor(commands).submit(plan_in(tmp_path, {"chain": 4}))
    assert info.value.message.startswith("job 3 of the chain of 4 was not queued: sbatch refused the job: sbatch: "
                                         "error: QOSMaxSubmitJobPerUserLimit; job(s) 100, 101 were")
    assert "--after 101:any" in info.value.hint
    assert [r["job_id"] for r in submissions(tmp_path / "run")] == ["100", "101"]


# ---- --after ----

@pytest.mark.parametrize("after,states,sacct,message", [
    ("999", {}, "", "--after 999: Slurm knows no job 999"),
    ("999:any", {}, None, "Slurm knows no job 999"),  # no accounting, and the controller does not know it
    ("5", {"5": "FAILED"}, None, "job 5 ended FAILED, so a job waiting for its success would never start"),
    ("5:ok", {}, "CANCELLED by 0\n", "job 5 ended CANCELLED"),  # only accounting remembers it
])
def test_a_dependency_that_cannot_work_submits_nothing(tmp_path, after, states, sacct, message):
    commands, queued = slurm(states, sacct=sacct)
    with pytest.raises(UserError) as info:
        SbatchExecutor(commands).submit(plan_in(tmp_path, {"after": after}))
    assert message in str(info.value) and "\n" not in str(info.value) and info.value.exit_code == 2
    assert queued == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind,state", [("ok", "RUNNING"), ("ok", "COMPLETED"), ("any", "FAILED"), ("ok", "PENDING")])
def test_a_dependency_that_can_work_is_rendered_and_queued(tmp_path, kind, state):
    commands, queued = slurm({"5": state})
    sub = SbatchExecutor(commands).submit(plan_in(tmp_path, {"after": f"5:{kind}"}))
    assert f"#SBATCH --dependency=after{kind}:5\n" in Path(sub.script).read_text() and len(queued) == 1


def test_job_state_asks_the_controller_then_accounting():
    assert job_state("5", slurm({"5": "RUNNING"})[0]) == "RUNNING"
    assert job_state("5", slurm(sacct="COMPLETED\n")[0]) == "COMPLETED"
    assert job_state("5", slurm(sacct="")[0]) is None
    assert job_state("5", FakeCommands({}, installed=())) == "?"  # nobody to ask: not checked
    assert dependency_problem("afterany:5", "?") is None


def test_an_unreachable_controller_is_not_taken_for_a_job_slurm_does_not_know():
    """Issue 30: with the controller down, accounting's silence said "Slurm knows no job 5" (exit 2); a job
    queued a minute ago is not in accounting yet. Not checked, and sbatch then says Slurm is unreachable."""
    down = Completed(("scontrol",), 1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)")
    commands = FakeCommands({"scontrol": lambda argv: down, "sacct": lambda argv: Completed(tuple(argv), 0, "")},
                            installed=("scontrol", "sacct"))
    assert job_state("5", commands) == "?"
    commands.handlers["sacct"] = lambda argv: Completed(tuple(argv), 0, "COMPLETED\n")
    assert job_state("5", commands) == "COMPLETED"   # accounting that knows it still answers


def test_an_unanswerable_dependency_is_a_warning(tmp_path, capsys):
    commands = FakeCommands({"sbatch": lambda argv: Completed(tuple(argv), 0, "100\n")}, installed=("sbatch",))
    assert SbatchExecutor(commands).submit(plan_in(tmp_path, {"after": "5"})).job_id == "100"
    assert "could not ask Slurm about job 5 (--after): it is not checked" in capsys.readouterr().err


# ---- doctor's requeue mode ----

CONFIG = "Configuration data as of 2026-11-23T16:00:00\nJobRequeue              = 1\nJobSubmitPlugins        = (null)\n"


def test_read_slurm_config():
    commands = FakeCommands({"scontrol": lambda argv: Completed(tuple(argv), 0, CONFIG)})
    assert read_slurm_config(commands) == {"JobRequeue": "1", "JobSubmitPlugins": "(null)"}
    assert read_slurm_config(FakeCommands({}, installed=())) is None


@pytest.mark.parametrize("config,scontrol,level,says", [
    ({"JobRequeue": "1"}, "/usr/bin/scontrol", "ok", "requeue mode: scontrol requeue (JobRequeue=1: batch jobs may"),
    ({"JobRequeue": "0"}, "/usr/bin/scontrol", "ok", "JobRequeue=0: jobs requeue only when they ask, and hpc-ddp's"),
    ({"JobRequeue": "1", "JobSubmitPlugins": "lua"}, "/x/scontrol", "ok", "job_submit plugin (lua) may still"),
    (None, "/usr/bin/scontrol", "ok", "JobRequeue unknown"),
    (None, None, "warning", "requeue mode: a new job per attempt (sbatch --dependency=afterany): no scontrol"),
])
def test_requeue_mode(config, scontrol, level, says):
    finding = requeue_mode(config, scontrol)
    assert finding.level == level and says in finding.line() and "\n" not in finding.line()
    if level == "ok":
        assert "the next attempt becomes a new job that starts when the old one ends" in finding.message
        assert "the nodes are not checked from here" in finding.message


# ---- the batch script itself, in bash, with fake srun, scontrol and sbatch ----

FAKE_SRUN = """#!/bin/bash
# Act as the ranks would: the trainer's records, then its exit code ($FAKE_RC).
events="$RUN_DIR_FOR_FAKES/events.jsonl"
if [ "$FAKE_RC" = 75 ]; then
    printf '%s\\n' '{"event": "start"}' '{"event": "signal", "cause": "preempted"}' '{"event": "requeue_requested"}' >> "$events"
    mkdir -p "$RUN_DIR_FOR_FAKES/checkpoints" && echo step-000000010 > "$RUN_DIR_FOR_FAKES/checkpoints/latest"
else
    printf '%s\\n' '{"event": "resume", "step": 10}' '{"event": "finish", "step": 20}' >> "$events"
fi
exit "$FAKE_RC"
"""


@pytest.fixture
def batch(tmp_path, monkeypatch, weird_dir):
    """A run dir (with an awkward path) holding a real rendered script; fakes on PATH."""
    run_dir = weird_dir / "run"
    spec = spec_of(python=sys.executable, workdir=str(tmp_path))
    plan = Plan("sbatch", spec, str(run_dir), render_sbatch(spec, str(run_dir), generated_at="", command_line=""), "")
    write_run_dir(plan)
    (run_dir / "job.sbatch").write_text(plan.script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {"srun": FAKE_SRUN,
             "scontrol": '#!/bin/bash\necho "$*" >> "$RUN_DIR_FOR_FAKES/../scontrol-calls"\n'
                         '[ "$1" = requeue ] && echo "Requested operation is presently disabled for job $2" >&2\nexit 1\n',
             "sbatch": '#!/bin/bash\n{ echo "$PWD $*"; env | grep -c "^SLURM_JOB_ID="; } >> "$RUN_DIR_FOR_FAKES/../sbatch-calls"\n'
                       'echo "$FAKE_NEXT_JOB"\n'}
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("RUN_DIR_FOR_FAKES", str(run_dir))
    return run_dir


def run_job(run_dir, job_id, rc, next_job="0"):
    env = {**os.environ, "SLURM_JOB_ID": job_id, "SLURM_JOB_NODELIST": "hpcn1", "FAKE_RC": str(rc),
           "FAKE_NEXT_JOB": next_job, "SLURM_RESTART_COUNT": "0"}
    return subprocess.run(["bash", "job.sbatch"], check=False, cwd=run_dir, env=env, capture_output=True, text=True, timeout=120)


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_a_refused_requeue_queues_the_next_attempt_and_it_finishes(batch):
    done = run_job(batch, "5", 75, next_job="6")
    assert done.returncode == 75, done.stderr
    assert "scontrol requeue 5 failed: Requested operation is presently disabled for job 5" in done.stderr
    assert "the next attempt is job 6, queued to start when this one ends" in done.stdout
    # sbatch ran in the run dir, after job 5, without this allocation's SLURM_* variables.
    assert (batch.parent / "sbatch-calls").read_text().splitlines() == [
        f"{batch} --parsable --dependency=afterany:5 job.sbatch", "0"]
    last = events(batch)[-2:]
    assert [e["event"] for e in last] == ["requeue", "requeue_fallback"] and last[1]["next_job"] == "6"
    record = json.loads((batch / "submissions.jsonl").read_text().splitlines()[-1])
    assert (record["job_id"], record["chain"], record["previous"], record["via"]) == ("6", "5", "5", "requeue_fallback")
    done = run_job(batch, "6", 0)  # the new job: the chain's second attempt, resumed, completed
    assert done.returncode == 0, done.stderr
    assert "attempt 0: restart 1 after preempted" in done.stdout
    starts = [e for e in events(batch) if e["event"] == "attempt_start"]
    assert [(e["job_id"], e.get("chain")) for e in starts] == [("5", None), ("6", "5")]
    assert events(batch)[-1]["cause"] == "completed"


def test_a_failed_fallback_ends_the_job_and_says_how_to_go_on(batch):
    (batch.parent.parent / "bin" / "sbatch").write_text("#!/bin/bash\necho 'sbatch: error: Invalid user' >&2\nexit 1\n")
    done = run_job(batch, "5", 75)
    assert done.returncode == 75
    assert "queueing the next attempt as a new job failed too: sbatch refused the job: sbatch: error: Invalid user" \
        in done.stderr and "HINT: go on by hand: cd " in done.stderr
    assert events(batch)[-1]["event"] == "gave_up"


def test_the_next_job_of_a_chain_ends_at_once_when_the_run_completed(batch):
    with open(batch / "submissions.jsonl", "a") as fh:
        fh.write(json.dumps({"executor": "sbatch", "job_id": "6", "chain": "5", "previous": "5", "via": "chain"}) + "\n")
    assert run_job(batch, "5", 0).returncode == 0
    done = run_job(batch, "6", 0)
    assert done.returncode == 0 and "the run already completed in job 5; nothing left to do" in done.stdout
    assert events(batch)[-1]["event"] == "skipped"
    assert not (batch.parent / "scontrol-calls").exists()  # nothing to requeue, nothing asked
