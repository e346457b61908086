"""docs/frameworks.md, "Rehearse a preemption here" (issue 42, item 7): an unmodified Lightning or Hugging
Face Trainer script under the local executor, stopped by `hpc-ddp preempt --signal TERM` as a preemption
stops it, runs again and completes from its own checkpoint, never hanging (30 s after the SIGTERM the ranks
still running are killed, as Slurm does)."""

import subprocess
import sys
import time

import pytest

from hpc_ddp.common.events import read_jsonl

from .helpers import hpc_ddp, wait_until
from .test_frameworks import HF_TRAINER, LIGHTNING

pytestmark = pytest.mark.e2e


def _lines(path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.parametrize("name,script,done", [("lightning", LIGHTNING, "done-0.txt"), ("hf", HF_TRAINER, "done.txt")])
@pytest.mark.extended
def test_a_framework_rehearsed_with_sigterm_runs_again_and_completes(tmp_path, name, script, done):
    (tmp_path / f"{name}.py").write_text(script)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--nodes", "2",
                             "--run-dir", "run", f"{name}.py", str(out)], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: _lines(out / "steps-0.txt") >= 12 or proc.poll() is not None, 240, "a dozen steps")
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        sent = hpc_ddp("preempt", "--signal", "TERM", "run", cwd=tmp_path, timeout=60)
        assert sent.returncode == 0 and "killed and the job runs again" in sent.stdout, sent.stdout + sent.stderr
        began = time.monotonic()
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-4000:]
    assert (out / done).exists(), output[-4000:]
    ends = [e["cause"] for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "attempt_end"]
    assert ends == ["preempted", "completed"], (ends, output[-4000:])
    assert time.monotonic() - began < 360
