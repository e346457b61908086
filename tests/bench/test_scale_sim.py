"""`make scale` in small: the whole simulation (bench/scale_sim.py) at 2 nodes x 8 ranks with short holds
(--quick), and the numbers it reports are real ones: every rank got through, operations and requests were
counted, the failure paths named the rank that was missing. The timings themselves are the benchmark's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("scale") / "scale_results.json"
    done = subprocess.run([sys.executable, "bench/scale_sim.py", "--nodes", "2", "--quick", "--label", "smoke",
                           "--out", str(out), "--phase-timeout", "60"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| staging: all-ready after the last node (s) |" in done.stdout  # the table was printed
    return json.loads(out.read_text())["runs"]["smoke"]["sizes"]["2"]


@pytest.mark.extended
def test_staging_every_rank_ready_and_the_shared_fs_counted(run):
    stage = run["stage"]
    assert stage["ranks"] == 16 and stage["ranks_ready"] == 16
    assert 0 < stage["time_to_all_ready_s"] < 30
    assert stage["shared_ops_total"] > 0 and stage["shared_ops_by_kind"]["stat"] > 0
    assert stage["shared_ops_per_s_measured"] > 0 and stage["shared_ops_per_s_asked"] > 0
    assert stage["local_ops_total"] > 0  # the node's other ranks polled their own disk
    assert stage["env_ms_per_rank"] > 0


def test_rendezvous_every_rank_joined_and_the_store_counted(run):
    rdv = run["rdv"]
    assert rdv["ranks"] == 16 and rdv["join"]["ranks_ready"] == 16
    assert rdv["join"]["requests"] > 16 and rdv["join"]["requests_per_s_measured"] > 0
    assert rdv["health"]["requests_per_rank"] > 0
    assert rdv["heartbeats"]["requests_per_s"] > 0
    assert rdv["requests_by_kind"]["connect"] >= 16


def test_failure_paths_name_the_missing_rank(run):
    rdv = run["rdv"]
    for path in ("fail_peer", "fail_health", "fail_barrier"):
        assert rdv[path]["requests"] > 0 and rdv[path]["callers"] == 15, path
    assert "rank 9 (sim0002)" in rdv["fail_peer"]["answer"]
    assert "rank 9 (sim0002) never reached it" in rdv["fail_health"]["answer"]
    assert rdv["fail_barrier"]["answer"] == "missing: [9]"


def test_attempts_and_status_over_the_run_dir(run):
    rundir = run["rundir"]
    assert rundir["attempts"]["attempts"] == 10 and rundir["attempts"]["shared_ops_per_attempt"] > 0
    status = rundir["status"]
    assert status["attempts_shown"] == 10 and status["state"] == "FAILED"
    assert status["failure"] == "ValueError: bad shard"
    # status reads the newest attempt's folder only, not every attempt's logs (ranks x attempts entries).
    assert status["shared_ops"] > 0 and status["entries_listed"] < rundir["log_files"] // 2
