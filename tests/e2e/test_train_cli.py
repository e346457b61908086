"""`hpc-ddp train` under torchrun, `make-dataset`, and `plot` of a run with a stop and a resume."""

import os
import subprocess
import sys

import pytest

from .helpers import hpc_ddp

pytestmark = pytest.mark.e2e

JOB = """[train]
dataset = "imagefolder"
data_dir = "data"
model = "cnn"
image_size = 16
batch_size = 8
num_workers = 1
log_every = 1
checkpoint_every_steps = 3
"""


@pytest.fixture
def imagefolder_job(tmp_path):
    made = hpc_ddp("make-dataset", "imagefolder", "data", "--train", "16", "--test", "4", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert "Wrote the imagefolder dataset" in made.stdout
    (tmp_path / "job.toml").write_text(JOB)
    return tmp_path


def test_train_under_torchrun(imagefolder_job):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", "29731", "-m", "hpc_ddp", "train", "--run-dir", "run", "job.toml"],
                          cwd=imagefolder_job, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    # 10 classes x 16 images = 160 samples / 2 ranks / 8 per batch = 10 steps
    assert "training finished at step 10" in done.stderr
    assert (imagefolder_job / "run" / "checkpoints" / "step-000000010" / "manifest.json").exists()


def test_plot_marks_stop_and_resume(imagefolder_job):
    done = hpc_ddp("submit", "--executor", "local", "--tasks-per-node", "2", "--run-dir", "run", "job.toml",
                   cwd=imagefolder_job, env={"HPC_DDP_FAULT_STOP_AT": "4"}, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    plotted = hpc_ddp("plot", "run", cwd=imagefolder_job)
    assert plotted.returncode == 0, plotted.stderr
    png = imagefolder_job / "run" / "training.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plot_of_an_empty_run_is_a_clear_error(tmp_path):
    (tmp_path / "run").mkdir()
    done = hpc_ddp("plot", "run", cwd=tmp_path)
    assert done.returncode == 2 and "has no training records yet" in done.stderr
