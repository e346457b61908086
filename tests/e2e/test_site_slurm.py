"""Site settings on the real test Slurm (2 nodes): the per-node setup runs once on each node before the
ranks, and the env table reaches every rank, expanded there."""

import json
from pathlib import Path

import pytest

from .helpers import submit_json, wait_for_job

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

PROBE = """
import json, os, pathlib
rank = os.environ["RANK"]
node = os.environ["SLURMD_NODENAME"]
marker = pathlib.Path(f"/tmp/hpc-ddp-node-setup-{os.environ['SLURM_JOB_ID']}-{node}")
seen = {k: os.environ.get(k) for k in ("NCCL_SOCKET_IFNAME", "NODE_TAG", "HF_HOME")}
seen.update(rank=rank, node=node, setup_ran_first=marker.exists())
pathlib.Path(os.environ["HPC_DDP_RUN_DIR"], f"probe-{rank}.json").write_text(json.dumps(seen))
"""


def test_node_setup_runs_once_per_node_and_env_reaches_every_rank(slurm_conf, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "job.toml").write_text("""
script = "probe.py"
nodes = 2
tasks_per_node = 2
node_setup = [
    'echo "$SLURMD_NODENAME $SLURM_NODEID $NCCL_SOCKET_IFNAME" >> "$HPC_DDP_RUN_DIR/node-setup.txt"',
    'touch "/tmp/hpc-ddp-node-setup-$SLURM_JOB_ID-$SLURMD_NODENAME"',
]
[env]
NCCL_SOCKET_IFNAME = "lo"
NODE_TAG = "$SLURMD_NODENAME-r$RANK"
HF_HOME = "/tmp/hf $$HOME"
""")
    job = submit_json("--run-dir", "site", "job.toml", cwd=tmp_path)["job_id"]
    run_dir = tmp_path / "site"
    state = wait_for_job(job, timeout=120)
    for marker in Path("/tmp").glob(f"hpc-ddp-node-setup-{job}-*"):  # what the setup left on each node
        marker.unlink()
    assert state == "COMPLETED", (run_dir / f"logs/slurm-{job}.out").read_text()
    lines = sorted((run_dir / "node-setup.txt").read_text().splitlines())
    assert lines == ["hpcn1 0 lo", "hpcn2 1 lo"]  # once on each node, with the site's env
    probes = [json.loads((run_dir / f"probe-{r}.json").read_text()) for r in range(4)]
    for p in probes:
        assert p["setup_ran_first"] and p["NCCL_SOCKET_IFNAME"] == "lo" and p["HF_HOME"] == "/tmp/hf $HOME"
        assert p["NODE_TAG"] == f"{p['node']}-r{p['rank']}"
    assert [p["node"] for p in probes] == ["hpcn1", "hpcn1", "hpcn2", "hpcn2"]
    log = (run_dir / f"logs/slurm-{job}.out").read_text()
    assert "per-node setup failed" not in log
