"""Real DDP (gloo, CPU) through the local executor: 2 simulated nodes x 2 GPUs = 4 processes."""

import json

import pytest

from .helpers import check_probe, copy_probe, hpc_ddp, read_probe

pytestmark = pytest.mark.e2e


def test_local_two_nodes_two_gpus(tmp_path):
    copy_probe(tmp_path)
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "2", "--gpus", "2", "--run-dir", "run", "--json",
                   "allreduce_probe.py", "--", "--flag", "a b", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout[done.stdout.index("{"):])
    assert result["state"] == "COMPLETED" and result["job_id"].startswith("local-")
    seen = read_probe(tmp_path / "run")
    check_probe(seen, nodes=2, tasks=2, master="127.0.0.1", node_names=None)
    assert all(r["argv"] == ["--flag", "a b"] and r["cwd"] == str(tmp_path) for r in seen)
    logs = sorted((tmp_path / "run" / "logs").glob("job-local-*/attempt-0/rank-*.log"))
    assert [p.name for p in logs] == [f"rank-{i}.log" for i in range(4)]
    assert "all_reduce=6.0" in logs[3].read_text()


def test_local_failure_stops_every_rank(tmp_path):
    (tmp_path / "fail.py").write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n    sys.exit(3)\n"
        "time.sleep(120)\n")
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "1", "--tasks-per-node", "3", "--run-dir", "run",
                   "fail.py", cwd=tmp_path, timeout=60)
    assert done.returncode == 1
    assert "rank 1 exited with code 3; stopping the other ranks" in done.stderr
    assert "failed (exit code 3)" in done.stderr
