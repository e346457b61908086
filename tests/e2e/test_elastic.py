"""Resume at another world size, sample-exact (issue 32), on the local executor: a run on 4 ranks stopped at
step 5 resumes on 2 (a node range, keeping the global batch by accumulation) and trains exactly the
(epoch, index) multiset of an uninterrupted 4-rank run; a fixed-size run refuses another size, naming the
range option."""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from .helpers import hpc_ddp, job_field, run_through_requeues, submit_json, trained_keys, wait_until

pytestmark = pytest.mark.e2e
SCRIPT = Path(__file__).with_name("elastic_keys.py")


def _submit(tmp_path, run_dir, keys, *options, env=None):
    keys.mkdir(exist_ok=True)
    return hpc_ddp("submit", "--executor", "local", *options, "--run-dir", run_dir, "elastic_keys.py", "--",
                   str(keys), cwd=tmp_path, env=env)


@pytest.mark.extended
def test_a_run_resumed_on_half_its_ranks_trains_the_uninterrupted_samples(tmp_path):
    shutil.copy(SCRIPT, tmp_path)
    done = _submit(tmp_path, "whole", tmp_path / "whole-keys", "--nodes", "4")
    assert done.returncode == 0, done.stderr
    stopped = _submit(tmp_path, "run", tmp_path / "keys", "--nodes", "4", "--max-preemptions", "0",
                      env={"HPC_DDP_FAULT_STOP_AT": "5"})
    assert stopped.returncode != 0 and "checkpointed" in stopped.stderr, stopped.stderr
    resumed = _submit(tmp_path, "run", tmp_path / "keys", "--nodes", "1-2")   # locally a range runs on its most
    assert resumed.returncode == 0, resumed.stderr
    out = resumed.stdout + resumed.stderr
    assert "resumed on 2 ranks (saved by 4): global batch kept at 16 with gradient accumulation 1 -> 2" in out
    whole, parts = trained_keys(tmp_path / "whole-keys"), trained_keys(tmp_path / "keys")
    assert parts == whole and max(parts.values()) == 1 and sum(whole.values()) == 2 * (200 // 16 * 16)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e["from_world_size"], e["world_size"], e["grad_accum"]) for e in events if e["event"] == "resized"] \
        == [(4, 2, 2)]


def test_a_run_stopped_on_4_ranks_mid_epoch_resumes_on_3_with_uneven_batches_and_exact_samples(tmp_path):
    """Issue 44: a global batch of 16 (4 ranks x 4) does not split into whole batches of 4 on 3 ranks; the
    resume goes on with 2 micro-steps of 8 a step (3, 3, 2 a rank, each weighted by its share) and trains the
    uninterrupted multiset."""
    shutil.copy(SCRIPT, tmp_path)
    done = _submit(tmp_path, "whole", tmp_path / "whole-keys", "--nodes", "4")
    assert done.returncode == 0, done.stderr
    stopped = _submit(tmp_path, "run", tmp_path / "keys", "--nodes", "4", "--max-preemptions", "0",
                      env={"HPC_DDP_FAULT_STOP_AT": "5"})
    assert stopped.returncode != 0 and "checkpointed" in stopped.stderr, stopped.stderr
    resumed = _submit(tmp_path, "run", tmp_path / "keys", "--nodes", "1-3")
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out
    assert "global batch kept at 16 as 2 micro-steps of 8, per-rank batches 3 or 2 (was 4)" in out
    whole, parts = trained_keys(tmp_path / "whole-keys"), trained_keys(tmp_path / "keys")
    assert parts == whole and max(parts.values()) == 1 and sum(whole.values()) == 2 * (200 // 16 * 16)
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    resized = [e for e in events if e["event"] == "resized"]
    assert [(e["from_world_size"], e["world_size"], e["grad_accum"], e["batch_per_rank"]) for e in resized] \
        == [(4, 3, 2, [3, 3, 2])]


def test_a_resume_with_another_batch_size_is_refused_in_one_line(tmp_path):
    """Issue 43: resumed with batch_size 8 where it was saved with 4, 16 of 128 samples were never trained
    and the run ended COMPLETED."""
    shutil.copy(SCRIPT, tmp_path)
    stopped = _submit(tmp_path, "run", tmp_path / "keys", "--nodes", "4", "--max-preemptions", "0",
                      env={"HPC_DDP_FAULT_STOP_AT": "5"})
    assert "checkpointed" in stopped.stderr, stopped.stderr
    again = _submit(tmp_path, "run", tmp_path / "keys", "--nodes", "2-4", env={"KEYS_BATCH": "8"})
    out = again.stdout + again.stderr
    assert again.returncode != 0 and "failed (exit code 2)" in out, out
    assert "cannot resume with batch_size 8: the checkpoint was saved with batch_size 4" in out
    assert "HINT: resume with batch_size=4" in out and "Traceback" not in out


@pytest.mark.extended
def test_a_fixed_size_run_refuses_another_size_and_names_the_range(tmp_path):
    shutil.copy(SCRIPT, tmp_path)
    stopped = _submit(tmp_path, "run", tmp_path / "keys", "--nodes", "4", "--max-preemptions", "0",
                      env={"HPC_DDP_FAULT_STOP_AT": "3"})
    assert "checkpointed" in stopped.stderr, stopped.stderr
    again = _submit(tmp_path, "run", tmp_path / "keys", "--nodes", "2")
    out = again.stdout + again.stderr
    assert again.returncode != 0 and "saved by 4 ranks, this run has 2" in out and "--nodes MIN-MAX" in out


@pytest.mark.slurm
def test_on_slurm_a_range_job_preempted_on_2_nodes_resumes_on_the_1_left_free(slurm_conf, tmp_path):
    """--nodes 1-2 starts on both nodes; a job in the urgent partition takes one of them; the preempted job
    is requeued, starts on the one left free and trains exactly the samples an uninterrupted run would."""
    from hpc_ddp.data.loaders import ResumableSampler

    shutil.copy(SCRIPT, tmp_path)
    (tmp_path / "keys").mkdir()
    job = submit_json("--partition", "debug", "--nodes", "1-2", "--run-dir", "run", "elastic_keys.py", "--",
                      str(tmp_path / "keys"), cwd=tmp_path, env={"KEYS_STEP_S": "0.3"})["job_id"]
    urgent = None
    try:
        wait_until(lambda: job_field(job, "JobState") == "RUNNING" and job_field(job, "NumNodes") == "2"
                   and list((tmp_path / "keys").glob("keys-*")), 120, "the job to train on 2 nodes")
        time.sleep(2)
        urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-N1", "--exclusive", "-o", "/dev/null", "--wrap",
                                 "sleep 90"], capture_output=True, text=True, check=True).stdout.strip()
        wait_until(lambda: int(job_field(job, "Restarts") or 0) > 0, 90, "the job to be preempted")
        assert run_through_requeues(job, timeout=300) == "COMPLETED"
    finally:
        for pending in (job, urgent):
            if pending and job_field(pending, "JobState") not in (None, "COMPLETED", "FAILED", "CANCELLED"):
                subprocess.run(["scancel", pending])
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e["from_world_size"], e["world_size"]) for e in events if e["event"] == "resized"] == [(2, 1)]
    trained = trained_keys(tmp_path / "keys")
    sampler = ResumableSampler(200, rank=0, world_size=1, seed=0)
    expected = collections.Counter()
    for epoch in range(2):
        sampler.set_position(epoch, 0)
        expected.update((epoch, i) for i in sampler.order()[:200 // 8 * 8])  # global batch 2 x 4
    assert trained == expected


@pytest.mark.slurm
@pytest.mark.extended
def test_on_slurm_a_2_4_job_started_on_4_resumes_on_the_2_left_free(slurm_conf, tmp_path):
    """Issue 32's case on 4 nodes (partition `wide`): --nodes 2-4 starts on all 4; a job in `urgent` takes
    hpcn1 and hpcn2 whole; the preempted job resumes on the 2 left free, global batch kept, samples exact."""
    from hpc_ddp.data.loaders import ResumableSampler

    nodes = subprocess.run(["sinfo", "-h", "-p", "wide", "-o", "%D"], capture_output=True, text=True).stdout.strip()
    if nodes != "4":
        pytest.skip("needs the test Slurm's 4 nodes (HPC_DDP_SLURM_NODES=4, slurm-up's default)")
    shutil.copy(SCRIPT, tmp_path)
    (tmp_path / "keys").mkdir()
    job = submit_json("--partition", "wide", "--nodes", "2-4", "--run-dir", "run", "elastic_keys.py", "--",
                      str(tmp_path / "keys"), cwd=tmp_path, env={"KEYS_STEP_S": "0.3"})["job_id"]
    urgent = None
    try:
        wait_until(lambda: job_field(job, "JobState") == "RUNNING" and job_field(job, "NumNodes") == "4"
                   and list((tmp_path / "keys").glob("keys-*")), 120, "the job to train on 4 nodes")
        time.sleep(2)
        urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-N2", "--exclusive", "-o", "/dev/null",
                                 "--wrap", "sleep 120"], capture_output=True, text=True, check=True).stdout.strip()
        wait_until(lambda: int(job_field(job, "Restarts") or 0) > 0, 90, "the job to be preempted")
        assert run_through_requeues(job, timeout=300) == "COMPLETED"
        assert job_field(urgent, "JobState") == "RUNNING"   # the 2 nodes it holds were never the job's again
    finally:
        for pending in (job, urgent):
            if pending and job_field(pending, "JobState") not in (None, "COMPLETED", "FAILED", "CANCELLED"):
                subprocess.run(["scancel", pending])
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e["from_world_size"], e["world_size"], e["grad_accum"]) for e in events if e["event"] == "resized"] \
        == [(4, 2, 2)]
    assert [e["nodes"] for e in events if e["event"] == "attempt_start"] == ["hpcn[1-4]", "hpcn[3-4]"]
    sampler = ResumableSampler(200, rank=0, world_size=1, seed=0)
    expected = collections.Counter()
    for epoch in range(2):
        sampler.set_position(epoch, 0)
        expected.update((epoch, i) for i in sampler.order()[:200 // 16 * 16])  # global batch 4 x 4
    assert trained_keys(tmp_path / "keys") == expected


@pytest.mark.slurm
def test_on_slurm_a_2_4_job_started_on_4_resumes_on_the_3_left_free_with_uneven_batches(slurm_conf, tmp_path):
    """Issue 44 on the test Slurm: --nodes 2-4 starts on all 4 (partition `wide`); a job in `urgent` takes one
    node; the preempted job resumes on the 3 left free, the global batch of 16 kept as 2 micro-steps of 8
    (3, 3, 2 a rank), and trains exactly the samples an uninterrupted run would."""
    from hpc_ddp.data.loaders import ResumableSampler

    nodes = subprocess.run(["sinfo", "-h", "-p", "wide", "-o", "%D"], capture_output=True, text=True).stdout.strip()
    if nodes != "4":
        pytest.skip("needs the test Slurm's 4 nodes (HPC_DDP_SLURM_NODES=4, slurm-up's default)")
    shutil.copy(SCRIPT, tmp_path)
    (tmp_path / "keys").mkdir()
    job = submit_json("--partition", "wide", "--nodes", "2-4", "--run-dir", "run", "elastic_keys.py", "--",
                      str(tmp_path / "keys"), cwd=tmp_path, env={"KEYS_STEP_S": "0.3"})["job_id"]
    urgent = None
    try:
        wait_until(lambda: job_field(job, "JobState") == "RUNNING" and job_field(job, "NumNodes") == "4"
                   and list((tmp_path / "keys").glob("keys-*")), 120, "the job to train on 4 nodes")
        time.sleep(2)
        urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-N1", "--exclusive", "-o", "/dev/null",
                                 "--wrap", "sleep 120"], capture_output=True, text=True, check=True).stdout.strip()
        wait_until(lambda: int(job_field(job, "Restarts") or 0) > 0, 90, "the job to be preempted")
        assert run_through_requeues(job, timeout=300) == "COMPLETED"
    finally:
        for pending in (job, urgent):
            if pending and job_field(pending, "JobState") not in (None, "COMPLETED", "FAILED", "CANCELLED"):
                subprocess.run(["scancel", pending])
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e["from_world_size"], e["world_size"], e["grad_accum"], e["batch_per_rank"]) for e in events
            if e["event"] == "resized"] == [(4, 3, 2, [3, 3, 2])]
    sampler = ResumableSampler(200, rank=0, world_size=1, seed=0)
    expected = collections.Counter()
    for epoch in range(2):
        sampler.set_position(epoch, 0)
        expected.update((epoch, i) for i in sampler.order()[:200 // 16 * 16])  # global batch 4 x 4
    assert trained_keys(tmp_path / "keys") == expected


TRAINER_JOB = """script = ""
[train]
dataset = "fake"
fake_size = 256
image_size = 8
model = "mlp"
epochs = 2
batch_size = 8
num_workers = 0
log_every = 4
eval_every_epoch = false
"""


def test_the_trainer_resumes_on_half_its_ranks_with_the_global_batch_kept(tmp_path):
    """The built-in trainer on the same path (issue 32): 4 ranks stopped at step 3, resumed on 2 with
    accumulation 2, the same steps per epoch (256 // 32 = 8), finished at step 16."""
    (tmp_path / "job.toml").write_text(TRAINER_JOB.replace('script = ""\n', ""))
    stopped = hpc_ddp("submit", "--executor", "local", "--nodes", "4", "--max-preemptions", "0", "--run-dir", "run",
                      "job.toml", cwd=tmp_path, env={"HPC_DDP_FAULT_STOP_AT": "3"})
    assert "checkpointed" in stopped.stderr, stopped.stderr
    resumed = hpc_ddp("submit", "--executor", "local", "--nodes", "1-2", "--run-dir", "run", "job.toml", cwd=tmp_path)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out
    assert "global batch kept at 32 with gradient accumulation 1 -> 2" in out and "training finished at step 16" in out


@pytest.mark.extended
def test_the_trainer_resumes_on_3_of_4_ranks_with_uneven_batches(tmp_path):
    """Issue 44 on the built-in trainer: a global batch of 32 (4 x 8) on 3 ranks: 2 micro-steps of 16 (6, 5,
    5 a rank), the same 8 steps per epoch, finished at step 16 (it was refused before: 32 does not split by 3)."""
    (tmp_path / "job.toml").write_text(TRAINER_JOB.replace('script = ""\n', ""))
    stopped = hpc_ddp("submit", "--executor", "local", "--nodes", "4", "--max-preemptions", "0", "--run-dir", "run",
                      "job.toml", cwd=tmp_path, env={"HPC_DDP_FAULT_STOP_AT": "3"})
    assert "checkpointed" in stopped.stderr, stopped.stderr
    resumed = hpc_ddp("submit", "--executor", "local", "--nodes", "1-3", "--run-dir", "run", "job.toml", cwd=tmp_path)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out
    assert "global batch kept at 32 as 2 micro-steps of 16, per-rank batches 6 or 5 (was 8)" in out
    assert "training finished at step 16" in out
