"""`hpc-ddp rerun` reproduces a crash of the test Slurm here: a 2-node chain whose first job stops at step 6
(checkpoint, exit 75) and whose second job resumes from it and crashes at step 12; the rerun replays that
attempt through the local executor from a copy of the step-6 checkpoint and crashes the same way, the loss
in the message to the same six digits. The original run dir is not changed by a byte."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import hpc_ddp, wait_for_job

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

SCRIPT = Path(__file__).with_name("crash_at_step.py")
# The command line with `rerun` in it, until cli/app.py registers cmd_debug's COMMANDS.
CLI = ("import sys; from hpc_ddp.cli.app import cli; from hpc_ddp.cli.cmd_debug import rerun; "
       "'rerun' in cli.commands or cli.add_command(rerun); cli(sys.argv[1:])")


def rerun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI, "rerun", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def snapshot(path: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(path)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_crash_on_slurm_is_reproduced_here_from_the_checkpoint_its_attempt_started_from(slurm_conf, tmp_path):
    shutil.copy(SCRIPT, tmp_path / SCRIPT.name)
    run = tmp_path / "run"
    # --max-restarts 0: the crash ends its attempt (a restart in place would resume it from a later checkpoint).
    done = hpc_ddp("submit", "--json", "--nodes", "2", "--chain", "2", "--max-restarts", "0", "--run-dir", str(run),
                   SCRIPT.name,
                   "--", "--crash-at", "12", cwd=tmp_path, env={"HPC_DDP_FAULT_STOP_AT": "6"})
    assert done.returncode == 0, done.stderr
    first, second = json.loads(done.stdout)["job_ids"]
    assert (wait_for_job(first), wait_for_job(second)) == ("FAILED", "FAILED")  # exit 75, then the crash
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    crashed = [e for e in events if e.get("event") == "attempt_start" and e.get("job_id") == second]
    assert crashed and crashed[0]["checkpoint_step"] == 6
    before = snapshot(run)

    done = rerun(str(run), "--json", cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    outcome = json.loads(done.stdout)
    plan = outcome["rerun"]
    assert (plan["job_id"], plan["attempt"], plan["cause"], plan["checkpoint_step"]) == (second, 0, "failed", 6)
    assert (plan["nodes"], plan["tasks_per_node"]) == (2, 1)
    assert outcome["original_failure"].startswith("RuntimeError: crash at step 12 (resumed from step 6, world size 2,")
    assert outcome["rerun_failure"] == outcome["original_failure"]
    assert snapshot(run) == before  # not a byte of the original changed
    new = Path(plan["run_dir"])
    assert new.parent == tmp_path and json.loads((new / "rerun.json").read_text())["source_run_dir"] == str(run)
    resumes = [json.loads(line) for line in (new / "events.jsonl").read_text().splitlines()
               if json.loads(line).get("event") == "resume"]
    assert [(r["step"], Path(r["path"])) for r in resumes] == [(6, new / "checkpoints" / "step-000000006")]
