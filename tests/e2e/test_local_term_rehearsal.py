"""A preemption rehearsed with SIGTERM on the local executor behaves as Slurm's (issue 42, item 7): a rank
that logs "Received SIGTERM" and then sits idle (as Lightning's did, one rank of two) never hangs the run:
KillWait later the ranks are killed, the attempt ends preempted, and the next attempt runs."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl

from .helpers import hpc_ddp, wait_until

# Attempt 0: rank 1 notes the signal and sits idle; rank 0 ignores it and sits idle too. Attempt 1 finishes.
SCRIPT = """\
import os, signal, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["HPC_DDP_RESTART_COUNT"])
if attempt:
    print(f"attempt {attempt} done", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, (lambda *_: print("Received SIGTERM", flush=True)) if rank == 1 else signal.SIG_IGN)
print("training", flush=True)
while True:
    time.sleep(0.2)
"""


@pytest.mark.e2e
def test_a_sigterm_rehearsal_kills_after_killwait_and_requeues(tmp_path):
    (tmp_path / "stuck.py").write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--tasks-per-node",
                             "2", "--run-dir", "run", "stuck.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    try:
        wait_until(lambda: (tmp_path / "run" / "local.pid").exists() and any(
            "training" in p.read_text() for p in (tmp_path / "run" / "logs").rglob("*.log")) or proc.poll() is not None,
            120, "the ranks to start")
        sent = hpc_ddp("preempt", "--signal", "TERM", "run", cwd=tmp_path, timeout=60)
        assert sent.returncode == 0, sent.stdout + sent.stderr
        began = time.monotonic()
        output, _ = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    assert time.monotonic() - began < 120
    assert "killing them, as Slurm does after its KillWait" in output, output[-3000:]
    assert "attempt 1 done" in output
    ends = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e.get("event") == "attempt_end"]
    assert ends[0]["cause"] == "preempted", ends


@pytest.mark.e2e
def test_a_preempt_that_comes_after_training_finished_is_refused_not_reported_sent(tmp_path):
    """Issue 42, item 1: a preempt arriving after the end said "Sent SIGUSR2 to every rank", exit 0."""
    import shutil

    shutil.copy(Path(__file__).resolve().parents[2] / "examples" / "preemptible.py", tmp_path / "train.py")
    done = hpc_ddp("submit", "--executor", "local", "--epochs", "1", "--run-dir", "run", "train.py", cwd=tmp_path,
                   timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    late = hpc_ddp("preempt", "run", cwd=tmp_path, timeout=60)
    assert late.returncode == 2, late.stdout + late.stderr
    assert "has already finished training" in late.stderr and "Sent SIG" not in late.stdout


@pytest.mark.e2e
def test_preempting_a_framework_with_the_warning_signal_says_it_ignores_it(tmp_path):
    """docs/frameworks.md: Lightning leaves SIGUSR2 alone; the preempt says so, with the signal to send."""
    (tmp_path / "fit.py").write_text("import time\nif False:\n    import lightning\nprint('training', flush=True)\n"
                                     "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--run-dir", "run",
                             "fit.py"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: any("training" in p.read_text() for p in (tmp_path / "run" / "logs").rglob("*.log"))
                   if (tmp_path / "run" / "logs").exists() else proc.poll() is not None, 120, "the rank to start")
        sent = hpc_ddp("preempt", "run", cwd=tmp_path, timeout=60)
        assert sent.returncode == 0, sent.stderr
        assert "fit.py uses Lightning, which leaves SIGUSR2 alone" in sent.stderr
        assert "hpc-ddp preempt --signal TERM" in sent.stderr
        assert hpc_ddp("cancel", "run", cwd=tmp_path, timeout=120).returncode == 0
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
