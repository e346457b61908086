"""Hardening round 4 (issue 43): `hpc-ddp attach` never runs the program a debugger record of events.jsonl
names. The ranks write that file; the Python that runs the bridge is this hpc-ddp's for a local run and the
run's own interpreter (spec.json, written by submit) for a cluster's."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from hpc_ddp.cli.cmd_debug import _bridge_python
from hpc_ddp.debug import attach
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

EVIL = {"job_id": "55", "rank": 0, "node": "hpcn1", "slurm_job_id": "55", "python": "./evil.sh",
        "socket": "/tmp/hpc-ddp-1000/rank-55-0.sock", "owner_only": True}


def _run(tmp_path):
    spec = build_spec([Layer("t", {})], target=Target("script", "t.py"), workdir=str(tmp_path),
                      python="/cluster/venv/bin/python")
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    return SimpleNamespace(run_dir=tmp_path)


def test_a_debugger_record_does_not_choose_the_python_of_a_cluster_run(tmp_path):
    python = _bridge_python(_run(tmp_path), EVIL)
    assert python == "/cluster/venv/bin/python"
    command = attach.bridge_command(EVIL, python)
    assert "./evil.sh" not in command and command[command.index(python) + 1:] == [
        "-m", "hpc_ddp.job.debugrelay", "bridge", "--", EVIL["socket"]]


def test_a_debugger_record_does_not_choose_the_python_of_a_local_run(tmp_path):
    local = {**EVIL, "loopback": True}
    assert _bridge_python(_run(tmp_path), local) == sys.executable
    assert attach.bridge_command(local, sys.executable)[0] == sys.executable
