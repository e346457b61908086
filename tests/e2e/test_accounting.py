"""Slurm accounting (slurmdbd + MariaDB in the test Slurm), end to end: what `status`, `list` and
`timeline` make of a job that was preempted for real, one that hit its time limit, and one cancelled
while it was still pending."""

import json
import subprocess
import textwrap

import pytest

from .helpers import hpc_ddp, job_field, last_step, submit_json, wait_until
from .test_user_scripts import preempt

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

# A user's own loop on the public API: a step every 0.3 s, a checkpoint every 5 steps.
SCRIPT = textwrap.dedent("""
    import time
    import torch
    import hpc_ddp

    run = hpc_ddp.start(checkpoint_every_steps=5, log_every=1)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run.track(model=model, optimizer=optimizer)
    run.resume(total_steps=40)
    for epoch in run.epochs(1, batches_per_epoch=40):
        for _ in range(run.progress.batch_in_epoch, 40):
            time.sleep(0.3)
            loss = (model(torch.ones(1)) - 1.0).pow(2).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss, samples=8)
    run.finish()
""")

# A plain program that ignores the warning signal and runs past its time limit.
SLEEPER = textwrap.dedent("""
    import signal, time
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    print("sleeping", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def accounting_up(slurm_conf):
    done = subprocess.run(["sacctmgr", "-n", "-P", "show", "cluster", "format=Cluster"], capture_output=True,
                          text=True)
    assert done.returncode == 0 and "hpcddp" in done.stdout, (
        f"the test Slurm has no accounting (slurm-up starts slurmdbd): {done.stdout}{done.stderr}")
    return slurm_conf


def status_json(job_id: str, cwd) -> dict:
    done = hpc_ddp("status", "--json", job_id, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def accounted(job_id: str, cwd, state: str, timeout: float = 60) -> dict:
    """status, once sacct has the job's final record (slurmctld sends it to slurmdbd asynchronously)."""
    def ready():
        info = status_json(job_id, cwd)
        sched = info["scheduler"] or {}
        return info if sched.get("source") == "sacct" and sched.get("state") == state else None
    return wait_until(ready, timeout, f"sacct to say {state} for job {job_id}", interval=1)


@pytest.fixture(scope="module")
def timed_out_job(slurm_conf, tmp_path_factory):
    """A sleeper with a 1-minute limit, submitted when the module's first test starts: it waits out its
    time limit (60-90 s: slurmctld checks limits every 30 s) while the preemption test runs. It sits
    alone on hpcn4 (partition wide), where that test's urgent job (hpcn1-2) cannot preempt it."""
    folder = tmp_path_factory.mktemp("timelimit")
    (folder / "sleeper.py").write_text(SLEEPER)
    (folder / "job.toml").write_text('script = "sleeper.py"\nnodes = 1\ntime = "1:00"\n'
                                     "signal_lead = 10\nmax_requeues = 0\n")
    job = submit_json("--executor", "sbatch", "--partition", "wide", "--sbatch-arg=--nodelist=hpcn4", "--run-dir",
                      "run", "job.toml", cwd=folder)["job_id"]
    yield job, folder
    subprocess.run(["scancel", job], check=False, capture_output=True)  # already ended: nothing to do


@pytest.mark.slurm_core
def test_a_preempted_job_in_status_list_and_timeline(accounting_up, timed_out_job, tmp_path):
    (tmp_path / "loop.py").write_text(SCRIPT)
    job = submit_json("--executor", "sbatch", "--partition", "debug", "--nodes", "1", "--run-dir", "run",
                      "loop.py", cwd=tmp_path)["job_id"]
    run_dir = tmp_path / "run"
    wait_until(lambda: last_step(run_dir) >= 8, 120, "step 8")  # a torn last line is skipped there
    preempt(job)
    info = accounted(job, tmp_path, "COMPLETED", timeout=180)
    history = info["scheduler"]["history"]
    assert len(history) == 2 and history[0]["state"] in ("PREEMPTED", "REQUEUED"), history
    assert history[-1]["state"] == "COMPLETED" and history[-1]["exitcode"] == "0:0"
    assert info["state"] == "COMPLETED" and info["restarts"] == 1
    assert "1 preemption cost" in info["time_used"], info["time_used"]

    text = hpc_ddp("status", job, cwd=tmp_path).stdout
    assert "slurm accounting COMPLETED, elapsed" in text and "slurm runs       " in text
    assert "-> COMPLETED" in text

    listed = json.loads(hpc_ddp("list", "--json", cwd=tmp_path).stdout)
    mine = next(r for r in listed if r["job_id"] == job)
    assert mine["slurm"]["state"] == "COMPLETED" and mine["slurm"]["elapsed"] != "00:00:00"

    done = hpc_ddp("timeline", job, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    import matplotlib.image as mpimg

    img = mpimg.imread(run_dir / "timeline.png")
    assert img.shape[0] > 400 and img[..., :3].std() > 0.05
    from hpc_ddp.common.events import read_jsonl
    from hpc_ddp.watch.timeline import build_timeline

    tl = build_timeline(read_jsonl(run_dir / "events.jsonl"), read_jsonl(run_dir / "metrics.jsonl"))
    assert [s.nodes is not None for s in tl.spans] == [True, True]
    assert tl.spans[0].cause == "preempted" and tl.spans[1].cause == "completed"
    assert tl.spans[1].resume_step and tl.spans[0].checkpoints


@pytest.mark.slurm_core
@pytest.mark.extended
def test_a_job_that_hit_its_time_limit(accounting_up, timed_out_job):
    job, folder = timed_out_job
    info = accounted(job, folder, "TIMEOUT", timeout=150)
    assert info["state"] in ("STOPPED", "TIMEOUT"), info["state"]
    assert info["scheduler"]["elapsed"] >= "00:01:00"
    text = hpc_ddp("status", job, cwd=folder).stdout
    assert "slurm accounting TIMEOUT" in text
    listed = json.loads(hpc_ddp("list", "--json", cwd=folder).stdout)
    assert next(r for r in listed if r["job_id"] == job)["slurm"]["state"] == "TIMEOUT"


@pytest.mark.slurm_core
def test_a_job_cancelled_while_pending(accounting_up, tmp_path):
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    job = submit_json("--executor", "sbatch", "--partition", "debug", "--nodes", "1", "--run-dir", "run",
                      "--sbatch-arg=--begin=now+3600", "sleeper.py", cwd=tmp_path)["job_id"]
    wait_until(lambda: job_field(job, "JobState") == "PENDING", 30, f"job {job} to be pending")
    done = hpc_ddp("cancel", job, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    info = accounted(job, tmp_path, "CANCELLED")
    assert info["state"] == "CANCELLED" and info["attempts"] == []
    assert info["scheduler"]["elapsed"] == "00:00:00" and len(info["scheduler"]["history"]) == 1
    # Nothing ran: the timeline says so in one line.
    done = hpc_ddp("timeline", job, cwd=tmp_path)
    assert done.returncode == 2 and "has no attempt or training records yet" in done.stderr
    assert "Traceback" not in done.stderr
