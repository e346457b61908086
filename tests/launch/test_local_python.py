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


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="needs /usr/bin/python3")
@pytest.mark.parametrize("command", [["submit", "--dry-run"], ["submit"], ["doctor"]])
def test_a_ranks_python_without_hpc_ddp_is_refused_before_any_rank_starts(tmp_path, bare_python, command):
    (tmp_path / "train.py").write_text("print('ran')\n")
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", *command, "--executor", "local", "--python",
                           str(bare_python), *(["--run-dir", "run"] if command[0] == "submit" else []), "train.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HPC_DDP_PROFILES": str(tmp_path / "p.toml")})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot import hpc_ddp, which every rank runs" in done.stdout + done.stderr
    assert "HINT:" in done.stdout + done.stderr
    assert "ran" not in done.stdout.splitlines()
    assert not (tmp_path / "run").exists()
