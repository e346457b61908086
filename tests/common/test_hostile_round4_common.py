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


CONTROLS = ["\x1b[2J", "\x1b]0;pwned\x07", "\u202e", "\u202a", "\u2066", "\u2069", "\x9b", "\x7f", "\x00"]


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
