"""The README's rehearsal, as a reader would do it: examples/preemptible.py on the local executor, stopped
once by `hpc-ddp preempt`; it checkpoints, restarts, resumes and completes, and prints the lines the README
shows (numbers, paths and ids made alike)."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

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


def _commands() -> list[list[str]]:
    """The rehearsal's two command lines, as the README writes them (the comment cut off)."""
    text = (REPO / "README.md").read_text().split("## Rehearse here", 1)[1]
    block = text.split("```console\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line[2:], comments=True) for line in block.splitlines() if line.startswith("$ hpc-ddp ")]


@pytest.mark.e2e
def test_the_readmes_rehearsal_prints_what_it_shows(tmp_path):
    """Run as written, with the preempt 5 s after the first training line (issue 42, item 1): a person in
    another shell arrives while it still trains, and sees the stop, the checkpoint and the resume."""
    project = tmp_path / "proj"
    (project / "examples").mkdir(parents=True)
    shutil.copy(REPO / "examples" / "preemptible.py", project / "examples")
    submit, preempt = _commands()
    assert submit[:2] == ["hpc-ddp", "submit"] and preempt[:2] == ["hpc-ddp", "preempt"], (submit, preempt)
    env = {k: v for k, v in os.environ.items() if k != "EPOCHS"}
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp", *submit[1:]], cwd=project, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        wait_until(lambda: any(line.startswith("[rank 0] step ") for line in lines) or proc.poll() is not None,
                   180, "the first training line")
        time.sleep(5)
        assert proc.poll() is None, "".join(lines)[-3000:]
        sent = hpc_ddp(*preempt[1:], cwd=project, timeout=60)
        assert sent.returncode == 0, sent.stdout + sent.stderr
        proc.wait(timeout=600)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert proc.returncode == 0, output[-3000:]
    printed = {_alike(line, project) for line in output.splitlines()}
    missing = [line for line in _shown() if _alike(line, project) not in printed]
    assert missing == [], output[-3000:]
    assert "frame #" not in output  # a clean stop prints no trace (item 13)
