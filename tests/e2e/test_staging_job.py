"""Staging inside real jobs: 2 simulated nodes x 2 ranks (local executor), each node with a local disk
of its own; the trainer reads the staged copy."""

import json

import pytest

from hpc_ddp.data.datagen import write_mnist

from .helpers import hpc_ddp

pytestmark = pytest.mark.e2e

SHOW = """import hashlib, json, os, pathlib
root = pathlib.Path(os.environ["HPC_DDP_DATA_MNIST"])
digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file())).hexdigest()
out = pathlib.Path(os.environ["WORKSPACE"]) / f"seen-{os.environ['RANK']}.json"
out.write_text(json.dumps({k: os.environ.get(k) for k in ("DATASETS_PATH", "DATASETS", "HPC_DDP_DATA_MNIST",
                                                          "NODE_RANK")} | {"digest": digest}))
"""


def test_each_node_stages_once_and_every_rank_reads_it(tmp_path):
    write_mnist(tmp_path / "shared" / "mnist", train=512, test=64)
    (tmp_path / "show.py").write_text(SHOW)
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "2", "--tasks-per-node", "2", "--run-dir", "run",
                   "--stage", "shared/mnist", "show.py", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    seen = [json.loads((tmp_path / "run" / f"seen-{r}.json").read_text()) for r in range(4)]
    assert len({s["digest"] for s in seen}) == 1
    from hpc_ddp.launch.executors.local import node_scratch

    for s in seen:
        node = node_scratch(str(tmp_path / "run"), int(s["NODE_RANK"]))
        assert s["HPC_DDP_DATA_MNIST"] == str(node / "hpc-ddp-datasets" / "mnist")
        assert s["DATASETS"] == "mnist" and s["DATASETS_PATH"] == str(node / "hpc-ddp-datasets")
    copies = [line for line in done.stdout.splitlines() if "hpc-ddp stage: mnist:" in line and "MB/s" in line]
    assert len(copies) == 2, done.stdout  # once per node
    assert {line.split("]")[0] for line in copies} == {"[rank 0", "[rank 2"}  # by each node's local rank 0


def test_trainer_reads_the_staged_copy(tmp_path):
    data = write_mnist(tmp_path / "shared" / "mnist", train=256, test=64)
    (tmp_path / "job.toml").write_text(
        'nodes = 1\ntasks_per_node = 2\n[datasets]\nmnist = "shared/mnist"\n'
        '[train]\ndataset = "mnist"\ndata_dir = "shared/mnist"\nmodel = "mlp"\nbatch_size = 16\n'
        'num_workers = 0\neval_every_epoch = false\n')
    done = hpc_ddp("submit", "--executor", "local", "--run-dir", "run", "job.toml", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    from hpc_ddp.launch.executors.local import node_scratch

    staged = node_scratch(str(tmp_path / "run"), 0) / "hpc-ddp-datasets" / "mnist"
    assert f"hpc-ddp: reading the staged copy {staged} of {data}" in done.stdout
