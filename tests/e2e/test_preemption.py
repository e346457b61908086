"""Preemption and time limits on the real test Slurm (2 nodes x 2 fake GPUs, gloo):
signal -> checkpoint -> requeue -> exact resume, caps, and no requeue loops."""

import json
import random
import subprocess
import sys

import pytest

from hpc_ddp.common.events import read_jsonl
from hpc_ddp.data.datagen import write_mnist

from .helpers import (
    SLOW_MODEL,
    hpc_ddp,
    job_field,
    last_step,
    release_when_requeued,
    run_through_requeues,
    submit_json,
    wait_for_job,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

JOB = """
nodes = 2
gpus = 2
[train]
dataset = "mnist"
data_dir = "{data}"
model = "cnn"
epochs = 3
batch_size = 16
lr = 0.05
num_workers = 1
log_every = 1
checkpoint_every_steps = 25
"""
STEPS = 3 * 4096 // 4 // 16  # 3 epochs of 4096 samples over 4 ranks, 16 per batch


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    write_mnist(root / "mnist", train=4096, test=256)
    (root / "job.toml").write_text(JOB.format(data=root / "mnist"))
    return root


@pytest.fixture(scope="module")
def baseline(workspace):
    """The uninterrupted run, through the local executor (same world size, same arithmetic)."""
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "2", "--tasks-per-node", "2", "--run-dir", "base",
                   "job.toml", cwd=workspace, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _sha(workspace / "base")


def _sha(run_dir) -> str:
    done = hpc_ddp("inspect", "--json", str(run_dir), cwd=run_dir)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["step"] == STEPS
    return info["model_sha256"]


def _text(path) -> str:
    return path.read_text() if path.exists() else ""


def _status(job_id, cwd):
    done = hpc_ddp("status", "--json", job_id, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_preempted_twice_and_warned_once_ends_bitwise_identical(slurm_conf, workspace, baseline):
    rng = random.Random(1234)
    job = submit_json("--executor", "sbatch", "--run-dir", "sb", "job.toml", cwd=workspace)["job_id"]
    run_dir = workspace / "sb"
    at = 0
    for round_ in range(3):
        at = max(at, last_step(run_dir)) + rng.randint(15, 60)
        wait_until(lambda: last_step(run_dir) >= at, 240, f"step {at}")
        if round_ < 2:
            subprocess.run(["scontrol", "requeue", job], check=True)   # what preemption does
        else:
            assert hpc_ddp("preempt", job, cwd=workspace).returncode == 0  # the time-limit warning signal
        release_when_requeued(job)
    assert wait_for_job(job, timeout=300) == "COMPLETED"
    assert _sha(run_dir) == baseline
    status = _status(job, workspace)
    assert status["state"] == "COMPLETED" and status["restarts"] == 3 and len(status["resumes"]) == 3
    assert [a["ended"] for a in status["attempts"]] == ["preempted", "preempted", "preempted", "completed"]
    logs = hpc_ddp("logs", job, cwd=workspace).stdout
    assert "[attempt 3 rank 0]" in logs and "resumed from" in logs
    rank_logs = sorted(p.relative_to(run_dir).as_posix() for p in run_dir.glob("logs/job-*/attempt-*/rank-*.log"))
    assert rank_logs == [f"logs/job-{job}/attempt-{a}/rank-{r}.log" for a in range(4) for r in range(4)]


@pytest.mark.slurm_core
def test_time_limit_signals_checkpoints_requeues_and_finishes(slurm_conf, workspace):
    (workspace / "slowmodel.py").write_text(SLOW_MODEL)
    # 40 epochs x 4 steps x 0.25 s = 40 s of training. An attempt trains for less: the signal comes
    # 20 s before the 1-minute limit (or earlier: Slurm may send it up to a minute early).
    (workspace / "long.toml").write_text(
        'nodes = 2\ngpus = 2\n[train]\ndataset = "fake"\nfake_size = 256\nimage_size = 8\n'
        'model = "slowmodel:make"\nepochs = 40\nbatch_size = 16\nnum_workers = 0\nlog_every = 20\n'
        'eval_every_epoch = false\n')
    job = submit_json("--time", "1", "--signal-lead", "20", "--run-dir", "tl", "long.toml", cwd=workspace,
                      env={"PYTHONPATH": str(workspace)})["job_id"]
    run_dir = workspace / "tl"
    assert run_through_requeues(job) == "COMPLETED", _text(run_dir / "events.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    signals = [e for e in events if e["event"] == "signal"]
    assert signals and all(e["cause"] == "time_limit" for e in signals)
    assert any(e["event"] == "requeue" and e["reason"].startswith("time_limit") for e in events)
    assert events[-1]["event"] == "attempt_end" and events[-1]["cause"] == "completed"


def test_requeue_cap_stops_a_job_that_keeps_being_preempted(slurm_conf, workspace):
    job = submit_json("--max-preemptions", "1", "--run-dir", "cap", "job.toml", cwd=workspace)["job_id"]
    run_dir = workspace / "cap"
    for n in (20, None):
        target = (n or last_step(run_dir) + 20)
        wait_until(lambda: last_step(run_dir) >= target, 240, f"step {target}")
        subprocess.run(["scontrol", "requeue", job], check=True)
        release_when_requeued(job)
    assert wait_for_job(job, timeout=120) == "FAILED"
    gave_up = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "gave_up"]
    assert gave_up and "more than max_preemptions=1" in gave_up[-1]["reason"]
    status = _status(job, workspace)
    assert status["state"] == "STOPPED" and "max_preemptions=1" in status["gave_up"]
    human = hpc_ddp("status", job, cwd=workspace).stdout
    assert "not requeued" in human and "max_preemptions=1" in human


def test_start_up_crash_is_not_requeued(slurm_conf, workspace):
    (workspace / "crash.py").write_text("raise RuntimeError('bad config: no such file data.bin')\n")
    job = submit_json("--nodes", "2", "--gpus", "2", "--run-dir", "crash", "crash.py", cwd=workspace)["job_id"]
    assert wait_for_job(job, timeout=120) == "FAILED"
    assert job_field(job, "Restarts") == "0"
    status = _status(job, workspace)
    assert status["state"] == "FAILED" and status["restarts"] == 0
    assert status["failure"] == {"kind": "user_code_exception", "detail": "RuntimeError: bad config: no such file data.bin"}


def test_checkpointed_job_without_progress_is_not_requeued_in_a_loop(slurm_conf, workspace):
    """A program that keeps asking to be requeued without ever making progress is stopped."""
    (workspace / "loop.py").write_text("import sys\nsys.exit(75)\n")
    job = submit_json("--run-dir", "loop", "loop.py", cwd=workspace)["job_id"]
    run_dir = workspace / "loop"
    wait_until(lambda: "gave_up" in _text(run_dir / "events.jsonl") or
               job_field(job, "JobState") == "PENDING", 60, "the first attempt to end")
    if job_field(job, "JobState") == "PENDING":
        release_when_requeued(job)
    assert wait_for_job(job, timeout=60) in ("FAILED", "COMPLETED")
    reasons = [e["reason"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "gave_up"]
    assert reasons and ("before training started" in reasons[-1] or "no progress" in reasons[-1])
    assert int(job_field(job, "Restarts")) <= 1


def test_submitit_preempted_and_warned_ends_bitwise_identical(slurm_conf, workspace, baseline):
    job = submit_json("--executor", "submitit", "--run-dir", "si", "job.toml", cwd=workspace)["job_id"]
    run_dir = workspace / "si"
    at = 0
    for round_, how in enumerate(("requeue", "warning")):
        at = max(at, last_step(run_dir)) + 30
        wait_until(lambda: last_step(run_dir) >= at, 240, f"step {at}")
        if how == "requeue":
            subprocess.run(["scontrol", "requeue", job], check=True)
        else:
            subprocess.run(["scancel", "--signal=USR2", job], check=True)
        release_when_requeued(job)
    assert wait_for_job(job, timeout=300, run_dir=run_dir) == "COMPLETED", (run_dir / "events.jsonl").read_text()
    assert _sha(run_dir) == baseline
    events = read_jsonl(run_dir / "events.jsonl")
    assert [e["event"] for e in events].count("resume") == 2


def test_local_preempted_and_warned_ends_bitwise_identical(workspace, baseline):
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--nodes", "2",
                             "--tasks-per-node", "2", "--run-dir", "lo", "job.toml"], cwd=workspace,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = workspace / "lo"
    at = 0
    for sig in ("TERM", None):
        at = max(at, last_step(run_dir)) + 30
        wait_until(lambda: last_step(run_dir) >= at, 240, f"step {at}")
        args = ["preempt", "lo"] + (["--signal", sig] if sig else [])
        assert hpc_ddp(*args, cwd=workspace).returncode == 0
        wait_until(lambda: last_step(run_dir) > at + 5, 120, "the resumed run")
    assert proc.wait(timeout=300) == 0
    assert _sha(run_dir) == baseline
    assert [e["event"] for e in read_jsonl(run_dir / "events.jsonl")].count("resume") == 2
