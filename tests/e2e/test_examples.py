"""The README's rehearsal, as a reader would do it: examples/preemptible.py on the local executor, stopped
once by `hpc-ddp preempt`; it checkpoints, restarts, resumes and completes, and prints the lines the README
shows (numbers, paths and ids made alike)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl

from .helpers import hpc_ddp, wait_until

REPO = Path(__file__).resolve().parents[2]
MARKER = "<!-- checked by tests/e2e/test_examples.py -->"


def _shown() -> list[str]:
    text = (REPO / "README.md").read_text()
    block = text.split(MARKER, 1)[1].split("```console\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()


def _alike(line: str, project: Path) -> str:
    line = line.replace(str(project), "/home/ada/proj")
    line = re.sub(r"local-\d+-\d+", "<job>", line)
    return re.sub(r"\d[\d,.]*", "0", line).rstrip()


def _steps(run_dir: Path) -> int:
    return sum(1 for e in read_jsonl(run_dir / "metrics.jsonl") if "loss" in e)


@pytest.mark.e2e
def test_the_readmes_rehearsal_prints_what_it_shows(tmp_path):
    project = tmp_path / "proj"
    (project / "examples").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "preemptible.py", project / "examples")
    run_dir = project / "runs" / "rehearsal"
    command = [sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--tasks-per-node", "2",
               "--run-dir", "runs/rehearsal", "examples/preemptible.py"]
    # 20 epochs rather than 3: long enough that the stop lands mid-run on a fast machine too
    proc = subprocess.Popen(command, cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "EPOCHS": "20"})
    try:
        wait_until(lambda: (run_dir / "metrics.jsonl").exists() and _steps(run_dir) >= 3 or proc.poll() is not None,
                   180, "a few training steps")
        assert proc.poll() is None, proc.communicate()[0]
        sent = hpc_ddp("preempt", "runs/rehearsal", cwd=project, timeout=60)
        assert sent.returncode == 0, sent.stdout + sent.stderr
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    printed = {_alike(line, project) for line in output.splitlines()}
    missing = [line for line in _shown() if _alike(line, project) not in printed]
    assert missing == [], output[-3000:]
