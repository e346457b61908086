"""The local executor starts the ranks here: their Python must import hpc_ddp, checked before anything runs,
as the sbatch path's preflight does (issue 42, item 12): submit, its --dry-run and doctor --executor local."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.fixture
def bare_python(tmp_path) -> Path:
    """A Python that runs but has no hpc_ddp: a script that execs the system's with -I (isolated)."""
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec /usr/bin/python3 -I \"$@\"\n")
    python.chmod(0o755)
    return python


@pytest.fixture
def bare_venv(tmp_path) -> Path:
    """A venv without hpc_ddp: what a dry run, which runs nothing, can tell from its files."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, timeout=120)
    return tmp_path / "venv" / "bin" / "python"


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs /usr/bin/python3")
@pytest.mark.parametrize("command", [["submit", "--dry-run"], ["submit"], ["doctor"]])
def test_a_ranks_python_without_hpc_ddp_is_refused_before_any_rank_starts(tmp_path, bare_python, bare_venv, command):
    (tmp_path / "train.py").write_text("print('ran')\n")
    python = bare_venv if "--dry-run" in command else bare_python
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", *command, "--executor", "local", "--python",
                           str(python), *(["--run-dir", "run"] if command[0] == "submit" else []), "train.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HPC_DDP_PROFILES": str(tmp_path / "p.toml")})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot import hpc_ddp, which every rank runs" in done.stdout + done.stderr
    assert "HINT:" in done.stdout + done.stderr
    assert "ran" not in done.stdout.splitlines()
    assert not (tmp_path / "run").exists()


def test_a_dry_run_runs_nothing_and_reads_the_envs_files(tmp_path, bare_venv):
    """Issue 30: a dry run executes nothing, the ranks' Python included; our own venv passes, a Python whose
    env cannot be read (a wrapper script outside any env) is not refused."""
    from types import SimpleNamespace

    from hpc_ddp.checks.interpreter_check import installed_findings

    def spec(python):
        return SimpleNamespace(python=str(python), workdir=str(tmp_path), setup=(), container=None)

    (finding,) = installed_findings(spec(bare_venv), {})
    assert finding.level == "error" and "cannot import hpc_ddp" in finding.message
    assert installed_findings(spec(sys.executable), {}) == []
    marker = tmp_path / "executed"
    wrapper = tmp_path / "wrapper"
    wrapper.write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    wrapper.chmod(0o755)
    assert installed_findings(spec(wrapper), {}) == [] and not marker.exists()
    (tmp_path / "hpc_ddp").mkdir()
    (tmp_path / "hpc_ddp" / "__init__.py").write_text("")
    assert installed_findings(spec(bare_venv), {}) == []  # -m from the job's folder finds it there
