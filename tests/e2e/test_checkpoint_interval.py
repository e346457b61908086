"""checkpoint_every_minutes = "auto" (issue 44) end to end: the built-in trainer records each interval it
chooses and why, on the local executor (no sacct asked) and on the test Slurm (the partition's sacct asked
once, on rank 0, and the interval chosen again with its answer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .helpers import hpc_ddp, submit_json, wait_for_job

pytestmark = pytest.mark.e2e

JOB = """[train]
dataset = "fake"
fake_size = 512
image_size = 8
model = "mlp"
epochs = 3
batch_size = 8
num_workers = 0
log_every = 8
eval_every_epoch = false
checkpoint_every_minutes = "auto"
"""


def _intervals(run_dir: Path) -> list[dict]:
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"] == "checkpoint_interval"]


def test_the_trainer_records_its_auto_interval_on_the_local_executor(tmp_path):
    (tmp_path / "job.toml").write_text(JOB)
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "2", "--run-dir", "run", "job.toml", cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    chosen = _intervals(tmp_path / "run")
    assert chosen and chosen[0]["sources"]["sacct"]["note"] == "not a Slurm job: not asked"
    assert chosen[0]["seconds"] >= 60 and chosen[0]["why"].startswith("Young: sqrt(2 x ")
    assert 'checkpoint every' in out and '(checkpoint_every_minutes = "auto"; Young' in out
    shown = hpc_ddp("status", "run", cwd=tmp_path)   # status shows the interval in effect and why
    line = next(ln for ln in shown.stdout.splitlines() if ln.startswith("checkpoints "))
    assert f"every {chosen[-1]['seconds'] / 60:.1f} min (auto: Young: sqrt(2 x " in line, shown.stdout


@pytest.mark.slurm_core
@pytest.mark.slurm
def test_on_slurm_the_partitions_sacct_is_asked_once_and_the_interval_chosen_again(slurm_conf, tmp_path):
    (tmp_path / "job.toml").write_text(JOB.replace("epochs = 3", "epochs = 12"))
    job = submit_json("--partition", "debug", "--nodes", "2", "--run-dir", "run", "job.toml", cwd=tmp_path)["job_id"]
    assert wait_for_job(job, timeout=240, run_dir=tmp_path / "run") == "COMPLETED"
    chosen = _intervals(tmp_path / "run")
    notes = [c["sources"]["sacct"].get("note", "") for c in chosen]
    assert notes[0].startswith("asked about partition debug")
    assert any(n.startswith("partition debug, ") and "jobs in 7 days" in n for n in notes[1:]), notes
    assert all(c["nodes"] == 2 for c in chosen)
