"""--debug-rank asks the ranks' Python whether it has debugpy only when something will run (issue 30, "code
execution on a dry run"): a dry run, a sweep's dry run and `render --stdout` execute nothing; a real submit
asks each distinct Python once, however many sweep tasks share it, and refuses one without debugpy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.fixture
def job(tmp_path):
    """A job file whose `python` records each time it is executed (and cannot import debugpy)."""
    marker = tmp_path / "executed"
    python = tmp_path / "fake-python"
    python.write_text(f"#!/bin/sh\necho \"$*\" >> {marker}\nexit 1\n")
    python.chmod(0o755)
    (tmp_path / "train.py").write_text("print('trained')\n")
    (tmp_path / "job.toml").write_text(f'python = "{python}"\nscript = "train.py"\n')
    return tmp_path, marker


def _debugpy_asked(marker):
    """The debugpy probes among the runs of the fake python (the compile check asks it too, with -I:
    checks/rankcompile.py)."""
    return [line for line in marker.read_text().splitlines() if line.startswith("-c ")]


def _hpc_ddp(cwd, *args):
    env = {**os.environ, "HPC_DDP_PROFILES": str(cwd / "profiles.toml")}
    return subprocess.run([sys.executable, "-m", "hpc_ddp", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize("args", [
    ("submit", "--executor", "local", "--dry-run", "--debug-rank", "0", "job.toml"),
    ("submit", "--executor", "sbatch", "--dry-run", "--debug-rank", "0", "job.toml"),
    ("submit", "--executor", "local", "--dry-run", "--debug-rank", "0", "--sweep", "lr=0.1,0.2,0.3", "job.toml"),
    ("render", "--stdout", "--debug-rank", "0", "job.toml"),
], ids=["dry-run-local", "dry-run-sbatch", "sweep-dry-run", "render-stdout"])
def test_a_dry_run_executes_nothing(job, args):
    cwd, marker = job
    done = _hpc_ddp(cwd, *args)
    assert done.returncode == 0, done.stderr
    assert "debugpy" in done.stdout + done.stderr  # the debug rank is planned (its argv or the debug line)
    assert not marker.exists(), marker.read_text()


def test_a_real_submit_asks_each_python_once_and_refuses_one_without_debugpy(job):
    cwd, marker = job
    done = _hpc_ddp(cwd, "submit", "--executor", "local", "--debug-rank", "0", "--sweep", "lr=0.1,0.2,0.3",
                    "--run-dir", "sweep", "job.toml")
    assert done.returncode == 2, done.stderr
    assert "--debug-rank 0: debugpy is not installed for" in done.stderr and "hpc-ddp[debug]" in done.stderr
    assert _debugpy_asked(marker) == ["-c import debugpy"]  # once for the three tasks
    assert not (cwd / "sweep").exists()  # refused before anything was written


def test_a_single_real_submit_refuses_a_python_without_debugpy(job):
    cwd, marker = job
    done = _hpc_ddp(cwd, "submit", "--executor", "local", "--debug-rank", "0", "--run-dir", "run", "job.toml")
    assert done.returncode == 2, done.stderr
    assert "debugpy is not installed for" in done.stderr
    assert _debugpy_asked(marker) == ["-c import debugpy"]
    assert not (cwd / "run").exists()
