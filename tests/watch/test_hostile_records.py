"""Records hpc-ddp did not write as they are (issue 30, bad errors): status, timeline and plot of a run dir
whose events.jsonl or metrics.jsonl holds a record of the wrong types, NaN or out-of-range times, or whose
submissions name an executor it does not know, answer as for the run without that record, or with one
line and exit 2; never with an internal error (exit 1)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from hpc_ddp.cli.app import cli
from hpc_ddp.common.events import well_formed

GOOD = {"event": "attempt_start", "attempt": 0, "job_id": "12", "time": 1_790_000_000.5}

HOSTILE = [
    {"event": "attempt_start", "attempt": "x", "time": "soon"},
    {"event": "attempt_end", "attempt": 0, "time": math.nan, "reason": 5},
    {"event": "attempt_start", "attempt": 0, "time": 1e308},
    {"event": "attempt_start", "attempt": 0, "time": math.inf},
    {"event": "checkpoint", "step": "a", "time": -1e300},
    {"event": "attempt_start", "attempt": 1e20, "time": 1},
    {"event": "attempt_start", "attempt": True, "time": 1},
    {"event": "progress", "step": None, "total_steps": "x", "time": 1},
    {"event": "attempt_end", "attempt": 0, "time": 5, "exit_code": 1e400},
    {"event": "attempt_end", "attempt": 0, "time": 5, "exit_code": 1 << 70},
    {"event": "attempt_start", "attempt": 0, "job_id": [1], "time": 5},
    {"event": ["attempt_start"], "attempt": 0, "time": 5},
    {"event": "start", "step": -3, "total_steps": 10, "time": 5},
]


def test_what_hpc_ddp_writes_is_well_formed():
    assert well_formed(GOOD)
    assert well_formed({"event": "finish", "step": 10, "epoch": 2, "time": 5, "loss": math.nan})  # a NaN loss is news
    assert well_formed({"event": "attempt_end", "attempt": 1, "exit_code": -15, "cause": "preempted", "time": 5})
    assert well_formed({"job_id": 123, "executor": "sbatch"})
    assert well_formed({"step": 40, "epoch": 1.5, "loss": 0.3, "time": 5})   # HF Trainer logs fractional epochs
    assert not well_formed({"step": 40, "epoch": math.nan, "time": 5})


@pytest.mark.parametrize("record", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_records_are_not_well_formed(record):
    assert not well_formed(record)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished local run, made once: each test copies it."""
    import subprocess
    import sys

    base = tmp_path_factory.mktemp("records")
    (base / "t.py").write_text("print('trained')\n")
    subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--run-dir", "run", "t.py"],
                   cwd=base, check=True, capture_output=True, timeout=180)
    return base / "run"


def _copy(run_dir, tmp_path):
    import shutil

    return shutil.copytree(run_dir, tmp_path / "run", symlinks=True)


@pytest.mark.parametrize("record", HOSTILE, ids=range(len(HOSTILE)))
def test_status_and_timeline_of_hostile_records_are_never_internal_errors(run_dir, tmp_path, record):
    run = _copy(run_dir, tmp_path)
    for name in ("events.jsonl", "metrics.jsonl"):
        with open(run / name, "a") as fh:
            fh.write(json.dumps(record) + "\n")
    runner = CliRunner()
    for command in (["status", str(run)], ["status", "--json", str(run)], ["timeline", str(run)]):
        done = runner.invoke(cli, command)
        assert done.exit_code in (0, 2), (command, done.output, done.exception)


def test_an_unknown_executor_in_the_submissions_is_one_line_exit_2(run_dir, tmp_path):
    run = _copy(run_dir, tmp_path)
    with open(run / "submissions.jsonl", "a") as fh:
        fh.write(json.dumps({"executor": "bogus\x1b[2J", "job_id": "7"}) + "\n")
    for command in (["status", str(run)], ["cancel", str(run)]):
        done = CliRunner().invoke(cli, command)
        assert done.exit_code == 2 and "which hpc-ddp does not know" in done.output, done.output
        assert "\x1b" not in done.output


@pytest.mark.parametrize("n", ["-1", "0"])
def test_list_takes_a_positive_count(n):
    done = CliRunner().invoke(cli, ["list", "-n", n])
    assert done.exit_code == 2 and "x>=1" in done.output, done.output


# Round 5's rerun (issue 53): records of hpc-ddp's shape whose numbers or nesting no arithmetic survives.
RAW_LINES = [
    json.dumps({"event": "restarted", "attempt": 0, "time": 1_790_000_010.0, "node_count": 10 ** 401,
                "nodes": "n1", "cause": "failed"}),
    json.dumps({"event": "restarted", "attempt": 0, "time": 1_790_000_010.0, "node_count": -4, "cause": "failed"}),
    "[" * 100_000 + "]" * 100_000,   # nested past Python's stack: RecursionError in json.loads
    '{"event": "progress", "step": 5, "time": 1790000011, "x": ' + "[" * 50_000 + "]" * 50_000 + "}",
]


@pytest.mark.parametrize("line", RAW_LINES, ids=["huge-node-count", "negative-node-count", "deep-list", "deep-field"])
def test_status_and_timeline_of_a_damaged_line_are_never_internal_errors(run_dir, tmp_path, line):
    run = _copy(run_dir, tmp_path)
    with open(run / "events.jsonl", "a") as fh:
        fh.write(line + "\n")
    runner = CliRunner()
    for command in (["status", str(run)], ["status", "--json", str(run)], ["timeline", str(run)]):
        done = runner.invoke(cli, command)
        assert done.exit_code == 0, (command, done.output, done.exception)
