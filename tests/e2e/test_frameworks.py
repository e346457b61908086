"""Issue 27: the frameworks researchers use survive real preemption on the test Slurm, unmodified.

An unmodified Lightning script catches SIGTERM and leaves with exit code 0; a plain script may trap SIGTERM,
save and exit 0 too. Neither is a completion: hpc-ddp asks Slurm what happened and runs the job again, once
per stop, and the script resumes from its own checkpoint. Jobs run side by side (2 nodes x 1 task each)
and one urgent job preempts them all, so the suite pays for one preemption, not one per case.
"""

import json
import random
import subprocess
import time
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl

from .helpers import hpc_ddp, job_field, submit_json, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")

LIGHTNING = """
# An unmodified Lightning 2 DDP script with Lightning's own checkpoints and resume: nothing of hpc_ddp.
import os, sys, time
import torch
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

out = sys.argv[1]


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, _index):
        time.sleep(0.25)
        with open(os.path.join(out, f"steps-{self.global_rank}.txt"), "a") as fh:
            fh.write(f"{self.global_step}\\n")
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = TensorDataset(torch.randn(640, 8), torch.randn(640, 1))
trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=2, strategy="ddp", max_steps=80,
                     callbacks=[ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), save_last=True,
                                                every_n_train_steps=5)],
                     enable_progress_bar=False, logger=False)
trainer.fit(Model(), DataLoader(data, batch_size=8), ckpt_path="last")
with open(os.path.join(out, f"done-{trainer.global_rank}.txt"), "w") as fh:
    fh.write(str(trainer.global_step))
"""

# torchrun-style shapes, each with its own progress file (rank 0 writes it after every step)
PLAIN_HEAD = """
import json, os, signal, sys, time
import torch, torch.distributed as dist

progress = sys.argv[1]
dist.init_process_group("gloo")
start = json.load(open(progress))["step"] if os.path.exists(progress) else 0
stop = []
"""
PLAIN_LOOP = """
def save(step):
    if dist.get_rank() == 0:
        with open(progress + ".tmp", "w") as fh:
            json.dump({"step": step}, fh)
        os.replace(progress + ".tmp", progress)

for step in range(start, 60):
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.25)
    save(step + 1)
    if stop:
        print(f"rank {dist.get_rank()}: SIGTERM: saved at step {step + 1}, leaving with exit code 0", flush=True)
        sys.exit(0)
dist.destroy_process_group()
"""
SHAPES = {
    # traps SIGTERM, saves and exits 0: the shape that was recorded "completed"
    "traps": PLAIN_HEAD + "signal.signal(signal.SIGTERM, lambda *_: stop.append(1))\n" + PLAIN_LOOP,
    # ignores SIGTERM: killed at the end of the grace time, then run again
    "ignores": PLAIN_HEAD + "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + PLAIN_LOOP,
}


def _preempt_all(jobs: list[str]) -> None:
    """One urgent job that needs both nodes whole preempts every job; each is released at once once
    requeued (Slurm would hold it ~120 s)."""
    restarts = {job: int(job_field(job, "Restarts") or 0) for job in jobs}
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "-N2", "--exclusive", "-o", "/dev/null",
                             "--wrap", "sleep 1"], capture_output=True, text=True, check=True).stdout.strip()
    for job in jobs:
        wait_until(lambda j=job: int(job_field(j, "Restarts") or 0) > restarts[j], 120, f"job {job} to be requeued")
    wait_until(lambda: job_field(urgent, "JobState") in ("COMPLETED", "FAILED", "CANCELLED", None), 60, "urgent job")
    time.sleep(5)  # Slurm still cleans up the preempted run for a moment ("Job credential revoked")
    for job in jobs:
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], capture_output=True)


def _wait_done(job: str, timeout: float = 400) -> str:
    return wait_until(lambda: (job_field(job, "JobState") or "") in ENDED and job_field(job, "JobState"),
                      timeout, f"job {job} to end")


def _steps(out: Path, rank: int) -> list[int]:
    path = out / f"steps-{rank}.txt"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _progress(path: Path) -> int:
    try:
        return json.loads(path.read_text())["step"]
    except (OSError, ValueError):
        return 0


def _ends(run_dir: Path) -> list[str]:
    return [e["cause"] for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "attempt_end"]


@pytest.mark.parametrize("seed", [27])
def test_unmodified_frameworks_preempted_for_real_are_run_again_and_complete(slurm_conf, tmp_path, seed):
    pytest.importorskip("pytorch_lightning", reason="a test-only dependency (make install puts it in .venv)")
    rng = random.Random(seed)
    (tmp_path / "fit.py").write_text(LIGHTNING)
    jobs, outs = {}, {}
    for name, partition in (("lightning-grace0", "debug"), ("lightning-grace15", "grace")):
        outs[name] = tmp_path / f"{name}-out"
        outs[name].mkdir()
        jobs[name] = submit_json("--executor", "sbatch", "--partition", partition, "--nodes", "2", "--run-dir", name,
                                 "fit.py", str(outs[name]), cwd=tmp_path)["job_id"]
    for name, text in SHAPES.items():
        (tmp_path / f"{name}.py").write_text(text)
        jobs[name] = submit_json("--executor", "sbatch", "--partition", "grace", "--nodes", "2", "--run-dir", name,
                                 f"{name}.py", str(tmp_path / f"{name}.json"), cwd=tmp_path)["job_id"]
    # a random step of every job, past Lightning's first checkpoint
    at = {name: rng.randrange(7, 30) for name in jobs}
    for name in jobs:
        if name.startswith("lightning"):
            wait_until(lambda n=name: len(_steps(outs[n], 0)) >= at[n], 300, f"{name} step {at[name]}")
        else:
            wait_until(lambda n=name: _progress(tmp_path / f"{n}.json") >= at[n], 300, f"{name} step {at[name]}")
    _preempt_all(list(jobs.values()))
    states = {name: _wait_done(job) for name, job in jobs.items()}
    logs = {name: hpc_ddp("logs", job, cwd=tmp_path).stdout[-3000:] for name, job in jobs.items()}
    assert states == dict.fromkeys(jobs, "COMPLETED"), (states, logs)
    for name, job in jobs.items():
        assert job_field(job, "Restarts") == "1", name  # exactly one requeue for the one stop
        assert _ends(tmp_path / name) == ["preempted", "completed"], (name, _ends(tmp_path / name))
        status = json.loads(hpc_ddp("status", "--json", job, cwd=tmp_path).stdout)
        assert [a["ended"] for a in status["attempts"]] == ["preempted", "completed"], (name, status["attempts"])
    for name in ("lightning-grace0", "lightning-grace15"):
        out = outs[name]
        assert (out / "done-0.txt").read_text() == "80"
        trained = _steps(out, 0)
        assert set(trained) == set(range(80)), (name, sorted(set(range(80)) - set(trained)))
        # the second attempt resumed from Lightning's own last.ckpt (a multiple of 5), not from step 0
        restart = trained.index(0, 1) if 0 in trained[1:] else None
        assert restart is None, f"{name} started over from step 0"
        resumed_at = next(trained[i] for i in range(1, len(trained)) if trained[i] <= trained[i - 1])
        assert resumed_at % 5 == 0 and resumed_at > 0, (name, resumed_at)
    for name in SHAPES:
        assert _progress(tmp_path / f"{name}.json") == 60, name
    grace0 = [e for e in read_jsonl(tmp_path / "lightning-grace0" / "events.jsonl") if e["event"] == "requeue"]
    assert grace0 and grace0[0]["by"] == "slurm"  # GraceTime 0: Slurm requeued it itself; hpc-ddp did not again
