"""Issue 52, item 7: a framework's own FSDP, preempted and resumed from the framework's own checkpoint, on CPU.

Under the local executor (1 node x 2 ranks, gloo), `hpc-ddp preempt --signal TERM` stops the run as a preemption
does; the next attempt must resume from the framework's checkpoint (a multiple of 5 past 0) and complete.

What runs FSDP on CPU (Lightning 2.6, accelerate 1.15, checked in this file):
- Lightning's `FSDPStrategy` refuses CPU, in the Trainer and in Fabric (test_..._fsdp_strategy_refuses_cpu).
  Its `ModelParallelStrategy` runs FSDP2 (`fully_shard`, every weight a DTensor sharded over the ranks) on CPU,
  in the Trainer and in Fabric, with distributed checkpoints: those two are preempted here for real.
- accelerate drops its FSDP plugin on CPU without a word and runs DDP: unproven (test_accelerate_...).
"""

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl

from .helpers import hpc_ddp, wait_until

pytestmark = pytest.mark.e2e

SCRIPTS = Path(__file__).parent / "frameworks_fsdp"
STEPS = 40  # the scripts' default is 60; 40 (8 s of steps) keeps each case near 30 s on 2 cores


def _steps(out: Path, rank: int) -> list[tuple[int, int]]:
    """(attempt, step) for every step rank `rank` trained, in order."""
    path = out / f"steps-{rank}.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(int(a), int(b)) for a, b in (line.split() for line in lines)]


def _submit(tmp_path: Path, script: str, env: dict | None = None) -> subprocess.Popen:
    (tmp_path / script).write_text((SCRIPTS / script).read_text())
    (tmp_path / "out").mkdir()
    return subprocess.Popen([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--nodes", "1",
                             "--tasks-per-node", "2", "--run-dir", "run", script, "out"], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})


@pytest.mark.parametrize("script,done,seed", [("lightning_model_parallel.py", "done-0.txt", 52),
                                              ("fabric_model_parallel.py", "done.txt", 53)])
@pytest.mark.extended
def test_lightning_fsdp2_on_cpu_rehearsed_preemption_resumes_from_its_own_checkpoint(tmp_path, script, done, seed):
    pytest.importorskip("lightning", reason="a test-only dependency (make install puts it in .venv)")
    out = tmp_path / "out"
    at = random.Random(seed).randrange(12, 24)  # a random step past the first checkpoints (every 5 steps)
    proc = _submit(tmp_path, script, env={"FSDP_STEPS": str(STEPS)})
    try:
        wait_until(lambda: len(_steps(out, 0)) >= at or proc.poll() is not None, 120, f"step {at}")
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        sent = hpc_ddp("preempt", "--signal", "TERM", "run", cwd=tmp_path, timeout=60)
        assert sent.returncode == 0 and "killed and the job runs again" in sent.stdout, sent.stdout + sent.stderr
        began = time.monotonic()
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output[-4000:]
    assert time.monotonic() - began < 120, output[-4000:]  # neither framework sat out the 30 s KillWait twice
    # FSDP for real: each rank held its own half of the first weight, a DTensor sharded on dim 0
    for rank in (0, 1):
        assert (out / f"sharded-{rank}.txt").read_text().strip() == \
            "DTensor (Shard(dim=0),) local (16, 8) of (32, 8)", rank
    # the framework's own checkpoint is a distributed checkpoint: one shard file per rank
    assert {p.name for p in (out / "ckpt").rglob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}
    ends = [e["cause"] for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "attempt_end"]
    assert ends == ["preempted", "completed"], (ends, output[-4000:])
    status = json.loads(hpc_ddp("status", "--json", "run", cwd=tmp_path).stdout)
    assert status["state"] == "COMPLETED" and status["restarts"] == 1, status
    assert [a["ended"] for a in status["attempts"]] == ["preempted", "completed"], status["attempts"]
    assert (out / done).read_text() == str(STEPS)
    for rank in (0, 1):
        trained = _steps(out, rank)
        assert {step for _, step in trained} == set(range(STEPS)), rank
        assert {attempt for attempt, _ in trained} == {0, 1}, rank
        # the second attempt resumed from the framework's newest checkpoint before the stop, not from step 0
        resumed_at = next(step for attempt, step in trained if attempt == 1)
        first = [step for attempt, step in trained if attempt == 0]
        assert resumed_at % 5 == 0 and 0 < resumed_at <= max(first) + 1, (rank, resumed_at, max(first))
        assert max(first) + 1 - resumed_at < 5 + 2, (rank, resumed_at, max(first))  # at most a checkpoint's worth


def test_lightning_fsdp_strategy_refuses_cpu():
    """Why the script above uses ModelParallelStrategy: FSDPStrategy (FSDP1) is GPU-only in Lightning 2.6
    (lightning/pytorch/trainer/connectors/accelerator_connector.py and lightning/fabric/connector.py, each in
    _check_strategy_and_fallback)."""
    L = pytest.importorskip("lightning", reason="a test-only dependency (make install puts it in .venv)")
    with pytest.raises(ValueError, match=r"The strategy `fsdp` requires a GPU accelerator, but received "
                                         r"`accelerator='cpu'`"):
        L.Trainer(strategy="fsdp", accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match="You selected the FSDP strategy but FSDP is only available on GPU"):
        L.Fabric(strategy="fsdp", accelerator="cpu", devices=2)


def test_accelerate_fsdp_plugin_on_cpu_falls_back_to_ddp_so_it_stays_unproven(tmp_path):
    """accelerate 1.15 sets DistributedType.FSDP only on accelerator devices (accelerate/state.py): on CPU it
    keeps MULTI_CPU, ignores the FSDP2 plugin without a warning, and prepare() wraps DDP. A preemption of it
    here would rehearse DDP, not FSDP: it is not run. This fails the day accelerate shards on CPU."""
    pytest.importorskip("accelerate", reason="a test-only dependency (make install puts it in .venv)")
    proc = _submit(tmp_path, "accelerate_fsdp.py", env={"FSDP_STEPS": "5"})
    output, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, output[-4000:]
    for rank in (0, 1):
        mode = json.loads((tmp_path / "out" / f"mode-{rank}.json").read_text())
        assert mode == {"distributed_type": "DistributedType.MULTI_CPU", "num_processes": 2, "is_fsdp2": False,
                        "wrapper": "DistributedDataParallel", "weight": "Parameter", "local_shape": [32, 8],
                        "shape": [32, 8]}, mode
    assert (tmp_path / "out" / "state" / "model.safetensors").exists()  # a DDP state, whole, not sharded
