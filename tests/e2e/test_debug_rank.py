"""--debug-rank: a real debugger (a DAP client, as VS Code is) attaches to rank 1 of a 2 x 2 local job, stops at
a breakpoint, reads a variable, continues, and the job completes: the other ranks waited for it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl

from .dap import DapClient
from .helpers import wait_until

pytestmark = pytest.mark.e2e
pytest.importorskip("debugpy")

SCRIPT = """\
import os
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ["HPC_DDP_COLLECTIVE_TIMEOUT"])))
secret = dist.get_rank() * 7 + 1
total = torch.tensor([float(secret)])
dist.all_reduce(total)  # BREAK: the other ranks wait here while rank 1 is stopped
print(f"total={total.item():g}", flush=True)
dist.destroy_process_group()
"""


def _debugger_event(run_dir: Path):
    return next((e for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "debugger"), None)


def test_attach_to_rank_1_of_a_2x2_local_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    line = SCRIPT.splitlines().index(next(x for x in SCRIPT.splitlines() if "# BREAK" in x)) + 1
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--nodes", "2",
                             "--tasks-per-node", "2", "--debug-rank", "1", "--run-dir", str(run_dir), str(script)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        event = wait_until(lambda: _debugger_event(run_dir), 60, "the debugger event")
        assert event["rank"] == 1 and event["listen"].startswith("127.0.0.1:") and event["loopback"]
        assert event["collective_timeout"] == event["rendezvous_timeout"] == 86400
        client = wait_until(lambda: _connect(event["port"]), 30, "debugpy listening")
        try:
            stopped = client.attach_and_break(str(script), line)
            assert client.local_variable(stopped["body"]["threadId"], "secret") == "8"  # rank 1: 1 * 7 + 1
            time.sleep(1)  # the others sit in the all-reduce meanwhile, and must still be there
            assert proc.poll() is None
            client.request("continue", threadId=stopped["body"]["threadId"])
            out, err = proc.communicate(timeout=60)
        finally:
            client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    assert out.count("total=46") == 4  # ranks 0..3 add 1 + 8 + 15 + 22
    log = next(run_dir.glob("logs/job-local-*/attempt-0/rank-1.log")).read_text()
    assert f"waits for a debugger (debugpy) on 127.0.0.1:{event['port']}" in log
    assert f"ssh -N -L {event['port']}:127.0.0.1:{event['port']}" in log


def _connect(port: int) -> DapClient | None:
    try:
        return DapClient("127.0.0.1", port)
    except OSError:
        return None

