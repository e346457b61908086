"""The test Slurms of tests/cluster (instance.sh): a second one beside the first gets a folder, ports, job ids
and sshd of its own, and stopping one never touches another's daemons, told apart by their SLURM_CONF."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

CLUSTER = Path(__file__).resolve().parent / "cluster"


def _instance(k: str | None, *commands: str, root: Path | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin"}
    if k is not None:
        env["HPC_DDP_SLURM_INSTANCE"] = k
    if root is not None:
        env["HPC_DDP_SLURM_ROOT"] = str(root)
    return subprocess.run(["bash", "-c", f'. "{CLUSTER}/instance.sh"; ' + "; ".join(commands)], env=env,
                          capture_output=True, text=True, timeout=60)


def test_each_instance_has_its_own_folder_ports_job_ids_and_sshd():
    said = {}
    for k in (None, "1", "2"):
        done = _instance(k, 'echo "$ROOT $CTLD_PORT $DBD_PORT $SLURMD_PORT $DB_PORT $FIRST_JOB_ID $SSHD_ROOT"')
        assert done.returncode == 0, done.stderr
        said[k] = done.stdout.split()
    assert said[None] == ["/var/tmp/hpc-ddp-slurm", "6817", "6819", "6830", "3316", "1", "/var/tmp/hpc-ddp-sshd"]
    assert said["1"] == ["/var/tmp/hpc-ddp-slurm-1", "6917", "6919", "6930", "3317", "100001",
                         "/var/tmp/hpc-ddp-sshd-1"]
    # No two instances share a folder, a port or a job id range (each instance's slurmds take 6830+100K and up)
    values = [v for words in said.values() for v in words]
    assert len(values) == len(set(values))
    sshd = _instance("1", 'echo "$SSHD_ENV"').stdout.split()
    assert sshd == ["HPC_DDP_SSHD_PORT=2322", "HPC_DDP_SSHD_ROOT=/var/tmp/hpc-ddp-sshd-1",
                    "HPC_DDP_REMOTE_USER=hpcremote1"]


@pytest.mark.parametrize("k", ["5", "-1", "x", "1;touch /tmp/no"])
def test_an_instance_out_of_range_is_one_line_and_exit_2(k):
    done = _instance(k, "echo reached")
    assert done.returncode == 2 and "reached" not in done.stdout
    assert done.stderr.strip().count("\n") == 0 and "HPC_DDP_SLURM_INSTANCE must be 0 to 4" in done.stderr


def test_our_daemons_are_those_with_this_instances_slurm_conf_only(tmp_path):
    """A "slurmd" of one test Slurm and one of another, by name alike: stop_our_daemons of the first stops its
    own and leaves the other running; a zombie or a process of another name is never listed. (Folders of
    this test's own: make test runs real test Slurms beside it.)"""
    fake = tmp_path / "slurmd"
    shutil.copy("/bin/sleep", fake)
    mine, yours = tmp_path / "a", tmp_path / "b"
    ours = subprocess.Popen([str(fake), "60"], env={"SLURM_CONF": f"{mine}/slurm.conf"})
    theirs = subprocess.Popen([str(fake), "60"], env={"SLURM_CONF": f"{yours}/slurm.conf"})
    other = subprocess.Popen(["sleep", "60"], env={"SLURM_CONF": f"{mine}/slurm.conf"})
    try:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{ours.pid}/comm").read_text().strip() != "slurmd" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _instance("1", "our_daemons", root=mine).stdout.split() == [str(ours.pid)]
        assert _instance("2", "our_daemons", root=yours).stdout.split() == [str(theirs.pid)]
        assert _instance("1", "stop_our_daemons", root=mine).returncode == 0
        assert ours.wait(timeout=10) is not None      # stopped (and reaped here: no zombie left listed)
        assert theirs.poll() is None and other.poll() is None
        assert _instance("1", "our_daemons", root=mine).stdout.split() == []
    finally:
        for proc in (ours, theirs, other):
            proc.kill()
            proc.wait()
