"""Issue 28 end to end on the test Slurm: the seeds' GPU scripts, unmodified, at 2 nodes x 2 GPUs with the
default binding, each rank on a GPU of its own.

Slurm's GPUs here are fake GRES devices, so tests/fakecuda (a model of CUDA, on the ranks' PYTHONPATH) runs
the scripts on the CPU while every device choice follows CUDA's rules under the CUDA_VISIBLE_DEVICES that
Slurm and hpc-ddp gave each rank, and records the physical GPU each rank used.
"""

import json
from pathlib import Path

import pytest

from hpc_ddp.data.datagen import write_mnist

from .helpers import submit_json, wait_for_job

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
SEEDS = REPO.parent / "shared" / "seeds"
FAKE_CUDA = REPO / "tests" / "fakecuda"


def _fake_cuda_env(log: Path, **extra: str) -> dict:
    log.mkdir()
    return {"PYTHONPATH": str(FAKE_CUDA), "FAKE_CUDA_GPUS": "2", "FAKE_CUDA_LOG": str(log), **extra}


def _used(log: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(log.glob("*.jsonl")) for line in f.read_text().splitlines()]


def _logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(run_dir.rglob("*.log")))


@pytest.mark.skipif(not SEEDS.is_dir(), reason="needs ../shared/seeds")
def test_seeds_001_and_003_unmodified_get_one_gpu_per_rank(slurm_conf, tmp_path):
    write_mnist(tmp_path / "mnist", train=256, test=64)
    common = ("--executor", "sbatch", "--nodes", "2", "--gpus", "2")
    jobs = {
        # torch.device('cuda') without set_device, nccl
        "001": submit_json(*common, "--run-dir", "s001", str(SEEDS / "linear_regression.py"),
                           cwd=tmp_path, env=_fake_cuda_env(tmp_path / "cuda-001")),
        # --local_rank, cuda:{local_rank}, device_ids=[local_rank], SyncBatchNorm; BACKEND=nccl as on its platform
        "003": submit_json(*common, "--run-dir", "s003", "--pass-local-rank", "--epochs", "1", "--batch-size", "32",
                           "--stage", str(tmp_path / "mnist"), str(SEEDS / "managed_platform_mnist.py"),
                           cwd=tmp_path, env=_fake_cuda_env(tmp_path / "cuda-003", HPC_DDP_BACKEND="nccl")),
    }
    for seed, job in jobs.items():
        run_dir = tmp_path / f"s{seed}"
        assert wait_for_job(job["job_id"], timeout=300, run_dir=run_dir) == "COMPLETED", _logs(run_dir)
        used = _used(tmp_path / f"cuda-{seed}")
        # every rank used exactly one GPU: the one of its own local rank, on its own node
        by_rank = {}
        for record in used:
            by_rank.setdefault(int(record["rank"]), set()).add((record["host"], record["gpu"]))
        assert sorted(by_rank) == [0, 1, 2, 3], used
        for rank, gpus in by_rank.items():
            node = f"hpcn{rank // 2 + 1}"
            assert gpus == {(node, f"GPU-fake-{node}-{rank % 2}")}, (seed, rank, gpus)
    assert "eval accuracy" in _logs(tmp_path / "s003")


def test_ranks_that_share_a_gpu_stop_at_start_up_with_one_line(slurm_conf, tmp_path):
    """A fixed cuda:0 on every rank: submit warns, and the job stops at init_process_group, naming both ranks
    of each node, instead of NCCL's 'Duplicate GPU detected' from inside torch."""
    (tmp_path / "fixed.py").write_text("import torch, torch.distributed as dist\n"
                                       "torch.cuda.set_device(0)\n"
                                       "dist.init_process_group('nccl')\n"
                                       "print('trained', flush=True)\n")
    job = submit_json("--executor", "sbatch", "--nodes", "2", "--gpus", "2", "--run-dir", "fixed", "fixed.py",
                      cwd=tmp_path, env=_fake_cuda_env(tmp_path / "cuda"))
    run_dir = tmp_path / "fixed"
    assert wait_for_job(job["job_id"], timeout=180, run_dir=run_dir) == "FAILED"
    logs = _logs(run_dir)
    assert "trained" not in logs
    assert "hpc-ddp: ranks 0 and 1 on node hpcn1 both use GPU 0 (cuda:0 of CUDA_VISIBLE_DEVICES=0,1)" in logs, logs
