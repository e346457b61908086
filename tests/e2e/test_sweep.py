"""A sweep on the real test Slurm: 4 tasks of 2-node DDP jobs in one array, at most 3 at once; one task
preempted (requeued by its own id) and resumed from its checkpoint while the others finish untouched."""

import json
import subprocess

import pytest

from hpc_ddp.common.events import read_jsonl

from .helpers import SLOW_MODEL, hpc_ddp, job_field, last_step, release_when_requeued, wait_for_job, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

# 3 epochs x 8 steps x 0.25 s (the pinned slow model): long enough to preempt one task mid-way.
JOB = """
nodes = 2
tasks_per_node = 1
[train]
dataset = "fake"
fake_size = 256
image_size = 8
model = "slowmodel:make"
epochs = 3
batch_size = 16
num_workers = 0
log_every = 1
checkpoint_every_steps = 4
eval_every_epoch = false
"""
STEPS = 3 * 256 // 2 // 16


def _task_status(workspace, job_id):
    done = hpc_ddp("status", "--json", job_id, cwd=workspace)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slurm_core
def test_a_sweep_of_two_node_jobs_with_one_task_preempted(slurm_conf, tmp_path):
    (tmp_path / "slowmodel.py").write_text(SLOW_MODEL)
    (tmp_path / "job.toml").write_text(JOB)
    done = hpc_ddp("submit", "--json", "--sweep", "lr=0.05,0.1", "--sweep", "seed=1,2", "--max-running", "3",
                   "--run-dir", "sweep", "job.toml", cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stdout + done.stderr
    submitted = json.loads(done.stdout[done.stdout.index("{"):])
    array = submitted["array_job_id"]
    tasks = submitted["tasks"]
    assert [t["job_id"] for t in tasks] == [f"{array}_{i}" for i in range(4)]
    assert [t["values"] for t in tasks] == [{"lr": 0.05, "train.seed": 1}, {"lr": 0.05, "train.seed": 2},
                                            {"lr": 0.1, "train.seed": 1}, {"lr": 0.1, "train.seed": 2}]
    sweep = tmp_path / "sweep"

    # Preempt task 1 by its own id once it has a checkpoint; the others run on.
    victim, run_dir = tasks[1]["job_id"], sweep / "task-1"
    wait_until(lambda: last_step(run_dir) >= 6, 240, "task 1 to pass step 6")
    subprocess.run(["scontrol", "requeue", victim], check=True)
    release_when_requeued(victim)
    for task in tasks:
        assert wait_for_job(task["job_id"], timeout=300) == "COMPLETED", task

    info = json.loads(hpc_ddp("status", "--json", str(sweep), cwd=tmp_path).stdout)
    assert [r["state"] for r in info["tasks"]] == ["COMPLETED"] * 4
    assert [r["step"] for r in info["tasks"]] == [STEPS] * 4
    assert [r["restarts"] for r in info["tasks"]] == [0, 1, 0, 0]
    table = hpc_ddp("status", array, cwd=tmp_path).stdout  # the array's id names the sweep too
    assert f"array job {array}; 4 tasks: 4 COMPLETED" in table and "lr=0.1 seed=2" in table

    preempted = _task_status(tmp_path, victim)
    assert [a["ended"] for a in preempted["attempts"]] == ["preempted", "completed"]
    assert preempted["resumes"] and preempted["resumes"][0]["step"] >= 4
    for i, task in enumerate(tasks):
        spec = json.loads((sweep / f"task-{i}" / "spec.json").read_text())
        assert (spec["train"]["lr"], spec["train"]["seed"]) == (task["values"]["lr"], task["values"]["train.seed"])
        # Each task ran under its own Slurm job (own id, own derived port) and wrote into its own run dir.
        starts = [e for e in read_jsonl(sweep / f"task-{i}" / "events.jsonl") if e["event"] == "attempt_start"]
        assert len(starts) == (2 if i == 1 else 1) and len({e["job_id"] for e in starts}) == 1
        assert (sweep / f"task-{i}" / "logs" / f"slurm-{task['job_id']}.out").is_file()
    assert job_field(victim, "Restarts") == "1"
    listing = hpc_ddp("list", cwd=tmp_path).stdout
    assert f"sweep {sweep}" in listing and "task 3: lr=0.1 seed=2" in listing
