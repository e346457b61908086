"""Issue 53: `--max-restarts` where nothing restarts inside an allocation (the local and submitit executors,
`hpc-ddp run`) was taken without a word. A note says so; under sbatch, whose batch script restarts, none."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

NOTE = "the {name} executor restarts nothing inside an allocation (only sbatch's batch script does)"


def _submit(tmp_path, *args):
    (tmp_path / "train.py").write_text("print('trained')\n")
    env = {**os.environ, "HPC_DDP_PROFILES": str(tmp_path / "profiles.toml")}
    for name in ("SLURM_JOB_ID", "SLURM_CONF"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--dry-run", *args, "train.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("executor", ["local", "submitit"])
def test_max_restarts_where_nothing_restarts_is_noted(tmp_path, executor):
    done = _submit(tmp_path, "--executor", executor, "--max-restarts", "3")
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if NOTE.format(name=executor) in line]
    assert notes == [f"hpc-ddp: warning: --max-restarts 3: {NOTE.format(name=executor)}; a crash ends the attempt, "
                     "and the requeue rules decide what follows"], done.stderr


@pytest.mark.parametrize("args", [["--executor", "sbatch", "--max-restarts", "3"], ["--executor", "local"],
                                  ["--executor", "local", "--max-restarts", "0"]])
def test_no_note_where_the_batch_script_restarts_or_nothing_was_asked(tmp_path, args):
    done = _submit(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    assert "restarts nothing inside an allocation" not in done.stderr
