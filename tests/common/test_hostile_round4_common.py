"""Hardening round 4 (issue 43), what common/ gives every command: a pid file is read as the bounded
regular-file readers read (a FIFO in its place never waited on, /dev/zero never read), and every error and
warning line reaches the terminal through the one printable filter (escapes and bidi controls shown)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpc_ddp.common.errors import UserError, report
from hpc_ddp.common.procs import read_pid_file
from hpc_ddp.common.terminal import printable


@pytest.mark.parametrize("make", ["fifo", "zero", "big", "dir"])
def test_a_pid_file_that_is_not_a_small_regular_file_is_not_read(tmp_path, make):
    path = tmp_path / "local.pid"
    if make == "fifo":
        os.mkfifo(path)
    elif make == "zero":
        os.symlink("/dev/zero", path)
    elif make == "big":
        path.write_text("1 " * 10_000)
    else:
        path.mkdir()
    who, tag, why = read_pid_file(path)
    assert who is None and tag is None
    if make != "dir":
        assert "not one hpc-ddp wrote" in why


@pytest.mark.parametrize("make", ["fifo", "zero"])
def test_cancel_of_a_run_whose_pid_file_is_a_fifo_or_dev_zero_is_one_line(tmp_path, make):
    run = tmp_path / "run"
    run.mkdir()
    (run / "spec.json").write_text(json.dumps({}))
    (run / "submissions.jsonl").write_text(json.dumps({"job_id": "1", "executor": "local"}) + "\n")
    if make == "fifo":
        os.mkfifo(run / "local.pid")
    else:
        os.symlink("/dev/zero", run / "local.pid")
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "cancel", str(run)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "no local job is running" in done.stderr, done.stderr
    assert "not a regular file" in done.stderr and len(done.stderr.strip().splitlines()) == 1


CONTROLS = ["\x1b[2J", "\x1b]0;pwned\x07", "\u202e", "\u202a", "\u2066", "\u2069", "\x9b", "\x7f", "\x00", "\u200f",
            "\u061c", "\u2028", "\u2029"]


@pytest.mark.parametrize("control", CONTROLS, ids=[ascii(c) for c in CONTROLS])
def test_every_error_line_goes_through_printable(capsys, control):
    assert report(UserError(f"bad {control} name", hint=f"rename {control}")) == 2
    err = capsys.readouterr().err
    assert control not in err and printable(control) in err


def test_warnings_and_information_go_through_printable(capsys):
    from hpc_ddp.common import verbosity

    verbosity.say("warning: branch \u202eevil\x1b[31m")
    err = capsys.readouterr().err
    assert "\u202e" not in err and "\x1b" not in err and "\\u202eevil\\x1b[31m" in err


def test_a_bidi_branch_and_an_escape_in_a_script_line_reach_the_terminal_shown(tmp_path):
    root = tmp_path / "proj"
    root.mkdir()
    (root / "t.py").write_text("import torch\ntorch.cuda.set_device(0)  # \u202e\x1b[2J\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q", "-b", "ma\u202ein"], cwd=root, check=True)
    subprocess.run([*git, "add", "-A"], cwd=root, check=True)
    subprocess.run([*git, "commit", "-qm", "x"], cwd=root, check=True)
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--dry-run", "--executor", "local", "--gpus", "2",
                           "t.py"], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for control in ("\u202e", "\x1b"):
        assert control not in done.stderr and control not in done.stdout
    assert "ma\\u202ein" in done.stderr and "\\u202e\\x1b[2J" in done.stderr


def test_a_timelines_texts_from_records_are_shown_not_obeyed():
    from hpc_ddp.watch.timeline import build_timeline

    events = [{"event": "attempt_start", "attempt": 0, "job_id": "1", "nodes": "n\x1b[2J", "time": 10.0},
              {"event": "signal", "cause": "pre\x1bempted\u202e", "step": 3, "time": 11.0},
              {"event": "gave_up", "reason": "r\x1b", "time": 12.0}]
    timeline = build_timeline(events, [])
    texts = [timeline.spans[0].nodes, timeline.spans[0].cause, timeline.gave_up[0][1],
             *(cause for _, cause, _ in timeline.spans[0].signals)]
    assert all("\x1b" not in t and "\u202e" not in t for t in texts), texts
    assert timeline.spans[0].cause == "pre\\x1bempted\\u202e"
