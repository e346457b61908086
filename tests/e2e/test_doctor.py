"""`hpc-ddp doctor` and submit's preflight against the real test Slurm (tests/cluster/slurm-up.sh):
partitions debug (default, no limit), short (10 minutes), grace and urgent (for real preemption), nodes
hpcn1 and hpcn2 with 4 CPUs, 4000 MB and gpu:2 each."""

import json

import pytest

from .helpers import copy_probe, hpc_ddp

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]


@pytest.mark.slurm_core
def test_doctor_reports_the_real_cluster(slurm_conf, tmp_path):
    done = hpc_ddp("doctor", cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[2:6]}
    assert rows["debug*"] == ["debug*", "up", "2", "4", "4000M", "2", "infinite", "hpcn[1-2]"]
    assert rows["short"] == ["short", "up", "2", "4", "4000M", "2", "0-00:10:00", "hpcn[1-2]"]
    assert rows["grace"] == ["grace", "up", "2", "4", "4000M", "2", "infinite", "hpcn[1-2]"]
    assert set(rows) == {"debug*", "short", "grace", "urgent"}
    assert "ok: sbatch --test-only accepts the job" in done.stdout

    out = json.loads(hpc_ddp("doctor", "--json", cwd=tmp_path, timeout=60).stdout)
    parts = {p["name"]: p for p in out["partitions"]}
    assert parts["debug"]["default"] and parts["debug"]["max_time"] is None and parts["short"]["max_time"] == 600
    assert [(n["name"], n["gpus"], n["cpus"], n["mem_mb"]) for n in parts["debug"]["nodes"]] == \
        [("hpcn1", 2, 4, 4000), ("hpcn2", 2, 4, 4000)]


@pytest.mark.parametrize("args,error", [
    (["--nodes", "3"], "error: --nodes 3: partition debug has only 2 node(s)"),
    (["--gpus", "4"], "error: --gpus 4: no node of partition debug has more than 2 GPUs"),
    (["--time", "20", "--partition", "short"], "error: time limit 0-00:20:00 is over partition short's limit"),
    (["--mem", "8G"], "error: --mem 8G: no node of partition debug has more than 4000M"),
])
def test_doctor_flags_what_cannot_fit(slurm_conf, tmp_path, args, error):
    copy_probe(tmp_path)
    done = hpc_ddp("doctor", *args, "allreduce_probe.py", cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert error in done.stdout and "HINT:" in done.stdout


@pytest.mark.slurm_core
def test_doctor_passes_what_fits_and_asks_sbatch(slurm_conf, tmp_path):
    copy_probe(tmp_path)
    done = hpc_ddp("doctor", "--nodes", "2", "--gpus", "2", "--time", "5", "--partition", "short",
                   "allreduce_probe.py", cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: 2 nodes x 2 GPUs, 2 CPUs fit partition short (2 of 2 nodes can take it)" in done.stdout
    assert "in partition short" in done.stdout  # sbatch --test-only's own answer
    # The test cluster is this one machine, so a script under /tmp is a warning, not an error.
    assert f"warning: script {tmp_path}/allreduce_probe.py is under /tmp" in done.stdout


def test_submit_that_cannot_fit_queues_nothing(slurm_conf, tmp_path):
    copy_probe(tmp_path)
    done = hpc_ddp("submit", "--time", "20", "--partition", "short", "--run-dir", "run", "allreduce_probe.py",
                   cwd=tmp_path, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert ("hpc-ddp: error: time limit 0-00:20:00 is over partition short's limit of 0-00:10:00: the job would "
            "wait in the queue forever; nothing was submitted") in done.stderr
    assert not (tmp_path / "run").exists() and "Submitted job" not in done.stdout
