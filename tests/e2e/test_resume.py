"""Bitwise-exact resume: world size 2 (gloo, CPU), DataLoader workers on, interrupted at many points.

Each interrupted run must end with the same model_sha256 and log the same loss at every step as the
uninterrupted run. Interruptions are real stops (flag -> checkpoint -> exit 75 -> restart by the local
executor) or a SIGKILL of rank 0 (no checkpoint; the rerun replays from the last periodic one).
"""

import json
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl
from hpc_ddp.common.rundir import checkpoint_step
from hpc_ddp.data.datagen import write_mnist

from .helpers import hpc_ddp

pytestmark = pytest.mark.e2e

JOB = """
nodes = 1
tasks_per_node = 2
[train]
dataset = "mnist"
data_dir = "{data}"
model = "cnn"
epochs = 2
batch_size = 16
lr = 0.05
num_workers = 2
log_every = 1
checkpoint_every_steps = 10
"""
STEPS = 64  # 1024 samples / 2 ranks / 16 per batch = 32 steps per epoch, 2 epochs


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    write_mnist(root / "mnist", train=1024, test=256)
    (root / "job.toml").write_text(JOB.format(data=root / "mnist"))
    return root


def train(workspace: Path, run: str, **env) -> tuple[int, str]:
    done = hpc_ddp("submit", "--executor", "local", "--run-dir", run, "job.toml", cwd=workspace,
                   env={k: str(v) for k, v in env.items()}, timeout=240)
    return done.returncode, done.stdout + done.stderr


def outcome(run_dir: Path) -> tuple[str, dict[int, set[float]]]:
    info = hpc_ddp("inspect", "--json", str(run_dir), cwd=run_dir)
    assert info.returncode == 0, info.stderr
    losses: dict[int, set[float]] = {}
    for record in read_jsonl(run_dir / "metrics.jsonl"):
        if "loss" in record:
            losses.setdefault(record["step"], set()).add(record["loss"])
    return json.loads(info.stdout)["model_sha256"], losses


@pytest.fixture(scope="module")
def baseline(workspace):
    rc, output = train(workspace, "base")
    assert rc == 0, output
    sha, losses = outcome(workspace / "base")
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(len(v) == 1 for v in losses.values())
    return sha, losses


@pytest.mark.parametrize("name,stop_at", [
    ("mid_epoch", "13"),
    pytest.param("right_before_a_checkpoint", "9", marks=pytest.mark.extended),
    ("at_a_checkpoint", "10"),
    pytest.param("right_after_a_checkpoint", "11", marks=pytest.mark.extended),
    ("epoch_boundary", "32"),
    ("twice", "5,47"),
])
def test_stop_and_resume_is_bitwise_exact(workspace, baseline, name, stop_at):
    rc, output = train(workspace, name, HPC_DDP_FAULT_STOP_AT=stop_at)
    assert rc == 0, output
    stops = stop_at.split(",")
    assert output.count("checkpointed at a stop request; restarting") == len(stops), output
    sha, losses = outcome(workspace / name)
    assert sha == baseline[0]
    assert losses == baseline[1]  # every step logged once, with the very same loss
    events = [e["event"] for e in read_jsonl(workspace / name / "events.jsonl")]
    assert events.count("resume") == len(stops) and events[-2:] == ["finish", "attempt_end"]


def test_kill_without_checkpoint_replays_from_the_last_one(workspace, baseline):
    rc, output = train(workspace, "killed", HPC_DDP_FAULT_KILL_AT="25")
    assert rc != 0, output
    # The last checkpoint committed before the kill: step 20, or step 10 where the step-20 save (written in
    # the background, at nice 19) had not finished within 5 steps, as under make test's CPU load.
    latest = (workspace / "killed" / "checkpoints" / "latest").read_text().strip()
    saved = checkpoint_step(latest)
    assert saved in (10, 20), latest
    rc, output = train(workspace, "killed")
    assert rc == 0, output
    assert f"resumed from {workspace / 'killed' / 'checkpoints'}" in output and f"(step {saved}," in output, output
    sha, losses = outcome(workspace / "killed")
    assert sha == baseline[0]
    # The steps after that checkpoint up to 25 ran twice (before the kill and after the resume) and logged the
    # same loss both times.
    assert {step: {min(v)} for step, v in losses.items()} == baseline[1] and all(len(v) == 1 for v in losses.values())


def test_incompatible_resume_is_refused(workspace, baseline):
    done = hpc_ddp("submit", "--executor", "local", "--run-dir", "base", "--lr", "0.2", "job.toml", cwd=workspace)
    assert done.returncode != 0
    assert "cannot resume from" in done.stdout + done.stderr and "lr: checkpoint 0.05, now 0.2" in done.stdout
