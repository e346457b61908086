"""Real DDP (gloo, CPU) on the test Slurm: 2 nodes x 2 fake GPUs, via sbatch and via submitit; 4 nodes x 1."""

import json

import pytest

from .helpers import check_probe, copy_probe, hpc_ddp, read_probe, submit_json, wait_for_job

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]


@pytest.mark.slurm_smoke
@pytest.mark.slurm_core
@pytest.mark.parametrize("executor", ["sbatch", "submitit"])
def test_two_nodes_two_gpus(slurm_conf, tmp_path, executor):
    copy_probe(tmp_path)
    done = hpc_ddp("submit", "--executor", executor, "--nodes", "2", "--gpus", "2", "--run-dir", "run", "--json",
                   "allreduce_probe.py", "--", "--lr", "0.1", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout[done.stdout.index("{"):])
    state = wait_for_job(result["job_id"])
    run_dir = tmp_path / "run"
    logs = "\n".join(p.read_text() for p in run_dir.rglob("*.log")) + "\n".join(
        p.read_text() for p in run_dir.rglob("*.out"))
    assert state == "COMPLETED", logs
    seen = read_probe(run_dir)
    check_probe(seen, nodes=2, tasks=2, master="hpcn1", node_names=["hpcn1", "hpcn2"])
    assert all(r["argv"] == ["--lr", "0.1"] for r in seen)
    assert all(r["HPC_DDP_JOB_ID"] == result["job_id"] and r["HPC_DDP_HOSTS"] == "hpcn1,hpcn2" for r in seen)
    rank_logs = sorted(run_dir.glob(f"logs/job-{result['job_id']}/attempt-0/rank-*.log"))
    assert len(rank_logs) == 4


@pytest.mark.slurm_core
def test_four_nodes_one_gpu_each(slurm_conf, tmp_path):
    """All four nodes of partition `wide`, one rank each: the environment of every rank, on every version."""
    copy_probe(tmp_path)
    job = submit_json("--nodes", "4", "--gpus", "1", "--partition", "wide", "--run-dir", "run", "allreduce_probe.py",
                      cwd=tmp_path)["job_id"]
    assert wait_for_job(job, run_dir=tmp_path / "run") == "COMPLETED"
    check_probe(read_probe(tmp_path / "run"), nodes=4, tasks=1, master="hpcn1",
                node_names=["hpcn1", "hpcn2", "hpcn3", "hpcn4"])


def test_sbatch_script_resubmits_from_its_header(slurm_conf, tmp_path):
    """The header says `cd RUN_DIR && sbatch job.sbatch`; doing exactly that runs the job again."""
    import subprocess

    copy_probe(tmp_path)
    done = hpc_ddp("render", "--nodes", "2", "--gpus", "1", "--run-dir", "run", "allreduce_probe.py", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "run"
    sub = subprocess.run(["sbatch", "--parsable", "job.sbatch"], cwd=run_dir, capture_output=True, text=True)
    assert wait_for_job(sub.stdout.strip().split(";")[0]) == "COMPLETED"
    assert len(read_probe(run_dir)) == 2


def test_staging_once_per_node_on_slurm(slurm_conf, tmp_path):
    """Each node stages into its own local disk (here: a directory named after the node)."""
    from hpc_ddp.data.datagen import write_mnist

    from .test_staging_job import SHOW

    write_mnist(tmp_path / "shared" / "mnist", train=256, test=64)
    (tmp_path / "show.py").write_text(SHOW)
    (tmp_path / "job.toml").write_text(
        f'script = "show.py"\nnodes = 2\ngpus = 2\nscratch = "{tmp_path}/local-$SLURMD_NODENAME"\n'
        f'[datasets]\nmnist = "shared/mnist"\n')
    done = hpc_ddp("submit", "--json", "--run-dir", "run", "job.toml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout[done.stdout.index("{"):])["job_id"]
    assert wait_for_job(job) == "COMPLETED"
    seen = [json.loads((tmp_path / "run" / f"seen-{r}.json").read_text()) for r in range(4)]
    assert len({s["digest"] for s in seen}) == 1
    for s in seen:
        node = "hpcn1" if s["NODE_RANK"] == "0" else "hpcn2"
        assert s["HPC_DDP_DATA_MNIST"] == f"{tmp_path}/local-{node}/hpc-ddp-datasets/mnist"
    logs = "".join(p.read_text() for p in (tmp_path / "run").glob("logs/job-*/attempt-0/rank-*.log"))
    assert logs.count("hpc-ddp stage: mnist:") == 2
