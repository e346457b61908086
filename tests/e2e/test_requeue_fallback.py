"""Where requeueing is impossible, and chains, on the real test Slurm (issue 14).

Requeue is made impossible per job, never by reconfiguring the shared cluster: SBATCH_NO_REQUEUE=1 in the
submitting shell (sbatch's own variable; it overrides the script's `#SBATCH --requeue`, so Slurm answers
`scontrol requeue` with "Requested operation is presently disabled", as at a site that forbids it), or a
setup line that puts an `scontrol` that is "not found" first on PATH (a node without Slurm's commands).
Either way the job that checkpoints and asks to be requeued must go on as a new job that waits for it,
and the run must end with every step trained once.
"""

import json
import subprocess

import pytest

from hpc_ddp.common.events import read_jsonl
from hpc_ddp.data.datagen import write_mnist

from .helpers import SLOW_MODEL, hpc_ddp, last_step, submit_json, wait_for_job

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

JOB = """
nodes = 1
tasks_per_node = 2
{extra}
[train]
dataset = "mnist"
data_dir = "{data}"
model = "cnn"
epochs = 2
batch_size = 16
lr = 0.05
num_workers = 0
log_every = 1
checkpoint_every_steps = 5
"""
STEPS = 2 * 512 // 2 // 16  # 2 epochs of 512 samples over 2 ranks, 16 per batch
STOP_AT = "11"              # the trainer acts as if a stop signal came after step 11: checkpoint, exit 75


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("fallback")
    write_mnist(root / "mnist", train=512, test=64)
    (root / "job.toml").write_text(JOB.format(data=root / "mnist", extra=""))
    fake = root / "no-scontrol"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/bash\necho \"$0: scontrol: command not found\" >&2\nexit 127\n")
    (fake / "scontrol").chmod(0o755)
    (root / "no_scontrol.toml").write_text(JOB.format(data=root / "mnist", extra=f'setup = ["export PATH={fake}:$PATH"]'))
    return root


def _submissions(run_dir):
    return read_jsonl(run_dir / "submissions.jsonl")


def _next_job(run_dir, after: str, timeout: float = 240) -> str:
    """The job queued after job `after` (by the fallback or the chain), once it is recorded."""
    from .helpers import wait_until

    found = wait_until(lambda: [r for r in _submissions(run_dir) if r.get("previous") == after], timeout,
                       f"a job queued after job {after}")
    return found[-1]["job_id"]


def _inspect_step(run_dir) -> int:
    done = hpc_ddp("inspect", "--json", str(run_dir), cwd=run_dir)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["step"]


def _trained_every_step_once(run_dir) -> None:
    """Steps 1..STEPS, each logged once but those replayed after the last checkpoint before the stop."""
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)) and _inspect_step(run_dir) == STEPS
    assert last_step(run_dir) == STEPS


@pytest.mark.parametrize("how,job_file,env,said", [
    ("forbidden", "job.toml", {"SBATCH_NO_REQUEUE": "1"}, "Requested operation is presently disabled"),
    ("no_scontrol", "no_scontrol.toml", {}, "scontrol: command not found"),
])
@pytest.mark.slurm_core
def test_a_job_that_cannot_be_requeued_goes_on_as_a_dependent_job(slurm_conf, workspace, how, job_file, env, said):
    out = submit_json("--run-dir", how, job_file, cwd=workspace, env={"HPC_DDP_FAULT_STOP_AT": STOP_AT, **env})
    first, run_dir = out["job_id"], workspace / how
    second = _next_job(run_dir, first)
    assert wait_for_job(first, timeout=240) == "FAILED"  # it ended with 75, handing over: no requeue
    assert wait_for_job(second, timeout=300) == "COMPLETED", (run_dir / "events.jsonl").read_text()
    events = read_jsonl(run_dir / "events.jsonl")
    fallback = next(e for e in events if e["event"] == "requeue_fallback")
    assert (fallback["job_id"], fallback["next_job"]) == (first, second) and said in fallback["why"]
    starts = [(e["job_id"], e.get("chain")) for e in events if e["event"] == "attempt_start"]
    assert starts == [(first, None), (second, first)]  # one chain: the policy counted across both jobs
    admitted = [e for e in events if e["event"] == "resume"]
    assert [e["step"] for e in admitted] == [int(STOP_AT)]
    assert events[-1]["event"] == "attempt_end" and events[-1]["cause"] == "completed"
    _trained_every_step_once(run_dir)
    record = _submissions(run_dir)[-1]
    assert (record["job_id"], record["chain"], record["via"]) == (second, first, "requeue_fallback")
    log = (run_dir / f"logs/slurm-{first}.out").read_text()
    assert f"scontrol requeue {first} failed" in log and f"the next attempt is job {second}" in log
    status = hpc_ddp("status", "--json", str(run_dir), cwd=workspace)
    assert json.loads(status.stdout)["state"] == "COMPLETED", status.stdout + status.stderr


@pytest.mark.slurm_core
def test_a_chain_hands_over_at_a_stop_and_its_last_job_ends_at_once(slurm_conf, workspace):
    out = submit_json("--chain", "3", "--run-dir", "chain", "job.toml", cwd=workspace,
                      env={"HPC_DDP_FAULT_STOP_AT": STOP_AT})
    jobs, run_dir = out["job_ids"], workspace / "chain"
    assert len(jobs) == 3 and jobs[0] == out["job_id"]
    assert [wait_for_job(j, timeout=300) for j in jobs] == ["FAILED", "COMPLETED", "COMPLETED"]
    events = read_jsonl(run_dir / "events.jsonl")
    handover = next(e for e in events if e["event"] == "requeue")
    assert handover["by"] == "chain" and handover["next_job"] == jobs[1]
    assert [(e["job_id"], e.get("chain")) for e in events if e["event"] == "attempt_start"] == \
        [(jobs[0], None), (jobs[1], jobs[0])]
    skipped = events[-1]
    assert skipped["event"] == "skipped" and skipped["job_id"] == jobs[2] and "already completed" in skipped["reason"]
    assert [e["event"] for e in events].count("finish") == 1  # the last job did not train again
    _trained_every_step_once(run_dir)
    # Job 1 did not requeue itself (job 2 was waiting): Slurm ran it once.
    assert "Restarts=0" in subprocess.run(["scontrol", "show", "job", jobs[0]], check=False, capture_output=True, text=True).stdout


@pytest.mark.extended
def test_a_chain_carries_a_run_past_short_time_limits_without_requeues(slurm_conf, workspace):
    """What --chain is for: a run longer than the time limit (1-minute jobs; 5 minutes of training), with
    no requeue allowed (--max-requeues 0). Job 1 stops at its time limit and job 2, queued up front, goes
    on from the checkpoint: that handover counts against no cap. Job 2, the last of the chain, stops at its
    own time limit, and there the cap holds: no requeue. (Slurm may send the warning up to a minute early,
    even while the ranks still import torch: the runner ignores it until the trainer's handler is in
    place, and the trainer's deadline stops it 20 s before the limit all the same.)"""
    (workspace / "slowmodel.py").write_text(SLOW_MODEL)
    (workspace / "long.toml").write_text(
        'nodes = 1\ntasks_per_node = 2\n[train]\ndataset = "fake"\nfake_size = 256\nimage_size = 8\n'
        'model = "slowmodel:make"\nepochs = 150\nbatch_size = 16\nnum_workers = 0\nlog_every = 20\n'
        'eval_every_epoch = false\n')  # 150 epochs x 8 steps x 0.25 s = 300 s: more than two 1-minute jobs train
    out = submit_json("--time", "1", "--signal-lead", "20", "--max-requeues", "0", "--chain", "2", "--run-dir",
                      "short", "long.toml", cwd=workspace, env={"PYTHONPATH": str(workspace)})
    jobs, run_dir = out["job_ids"], workspace / "short"
    assert [wait_for_job(j, timeout=400) for j in jobs] == ["FAILED", "FAILED"]  # both ended with 75
    events = read_jsonl(run_dir / "events.jsonl")
    assert [(e["job_id"], e.get("chain")) for e in events if e["event"] == "attempt_start"] == \
        [(jobs[0], None), (jobs[1], jobs[0])]
    handover = next(e for e in events if e["event"] == "requeue")
    assert handover == {**handover, "by": "chain", "next_job": jobs[1],
                        "reason": f"time_limit: job {jobs[1]}, queued after this one, goes on"}
    stopped_at = [e["step"] for e in events if e["event"] == "signal"]
    assert [e["step"] for e in events if e["event"] == "resume"] == stopped_at[:1] and stopped_at[0] > 0
    gave_up = events[-1]
    assert gave_up["event"] == "gave_up" and gave_up["reason"] == "time_limit: 1 requeues would exceed max_requeues=0"
    logs = "".join((run_dir / f"logs/slurm-{j}.out").read_text() for j in jobs)
    assert "requeueing job" not in logs and "attempt 0: restart 1 after time_limit" in logs
    for job in jobs:  # Slurm ran each job once
        show = subprocess.run(["scontrol", "show", "job", job], check=False, capture_output=True, text=True).stdout
        assert "Restarts=0" in show


def test_a_dependency_on_a_job_that_does_not_exist_submits_nothing(slurm_conf, workspace):
    done = hpc_ddp("submit", "--after", "987654", "--run-dir", "never", "job.toml", cwd=workspace)
    assert done.returncode == 2
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("hpc-ddp: error:")]
    assert len(errors) == 1 and "Slurm knows no job 987654" in errors[0]
    assert not (workspace / "never").exists()
