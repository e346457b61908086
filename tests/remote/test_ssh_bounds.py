"""Hardening round 5 (issue 53), the bounds of a call over ssh: a call is bounded on its process, never on
its pipes, so a child it leaves behind holding them (a ProxyCommand's `ssh -W`, rsync's remote shell, here
a `sleep &` of a fake ssh) cannot hold it; a control call (the probe, status, cancel, ...) that says nothing
for HPC_DDP_SSH_SILENCE_S (90 s) is lost, in one line, whatever the wall-clock bound; an rsync that prints
its progress is ended once silent well past its own --timeout. Fakes on PATH play ssh: no network, and a
hang costs a bound of a second."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hpc_ddp.common.errors import UserError
from hpc_ddp.remote import forward, ssh
from hpc_ddp.remote.submit import _rsync_3

CLI = [sys.executable, "-m", "hpc_ddp"]
# leaves a child that holds stdout and stderr, as a ProxyCommand's would, then hangs itself
HOLDS_PIPES = "sleep 30 & echo $! >> {pids}; exec sleep 30"


@pytest.fixture
def short():
    path = Path(tempfile.mkdtemp(prefix="hd5-", dir="/tmp"))
    yield path
    for line in (path / "pids").read_text().split() if (path / "pids").exists() else []:
        try:
            os.kill(int(line), signal.SIGKILL)  # the fakes' leftover children
        except ProcessLookupError:
            pass
    shutil.rmtree(path, ignore_errors=True)


def _fake_ssh(folder: Path, body: str) -> Path:
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "ssh"
    script.write_text(f"#!/bin/sh\ncat > /dev/null\n{body.format(pids=folder / 'pids')}\n")
    script.chmod(0o755)
    return bin_dir


def _box(short: Path, **env: str) -> ssh.Ssh:
    return ssh.Ssh("c", {"HPC_DDP_SSH_CONTROL_DIR": str(short / "c"), **env})


def _took(call) -> tuple[object, float]:
    start = time.monotonic()
    try:
        result = call()
    except UserError as exc:
        result = exc
    return result, time.monotonic() - start


def test_a_call_whose_child_keeps_its_pipes_open_ends_at_its_bound(short):
    box = _box(short, HPC_DDP_SSH_TIMEOUT_S="0.5")
    said, took = _took(lambda: box.bounded(["sh", "-c", HOLDS_PIPES.format(pids=short / "pids")]))
    assert isinstance(said, UserError) and "no answer within 0.5 s" in str(said) and took < 0.5 + ssh.DRAIN_S + 3


def test_a_call_that_ended_is_done_though_its_child_keeps_the_pipes(short):
    box = _box(short)
    done, took = _took(lambda: box.bounded(["sh", "-c", f"echo answer; sleep 30 & echo $! >> {short / 'pids'}"]))
    assert isinstance(done, ssh.Done) and done.returncode == 0 and done.stdout == b"answer\n"
    assert took < ssh.DRAIN_S + 3


def test_input_larger_than_a_pipe_reaches_the_command_whole(short):
    data = os.urandom(1 << 20)
    done = _box(short).bounded(["sh", "-c", "wc -c"], input=data)
    assert done.returncode == 0 and int(done.stdout) == len(data)


def test_silence_ends_a_self_bounded_call_but_output_that_keeps_coming_does_not(short):
    box = _box(short)
    said, took = _took(lambda: box.bounded(["sh", "-c", "exec sleep 30"], timeout=ssh.SELF_BOUNDED, silence=1))
    assert isinstance(said, UserError) and "said nothing for 1 s" in str(said) and "HPC_DDP_SSH_SILENCE_S" in str(said)
    assert took < 6
    talks = "for i in 1 2 3 4 5 6 7 8; do echo $i; sleep 0.3; done"
    done, took = _took(lambda: box.bounded(["sh", "-c", talks], timeout=ssh.SELF_BOUNDED, silence=1))
    assert isinstance(done, ssh.Done) and done.returncode == 0 and done.stdout.split()[-1] == b"8" and took > 2


def test_a_control_call_that_says_nothing_is_lost_after_the_silence_not_the_wall_clock(short, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_ssh(short, HOLDS_PIPES)}:{os.environ['PATH']}")
    box = _box(short, HPC_DDP_SSH_SILENCE_S="1")  # the wall-clock bound stays 900 s
    assert box.timeout_s == ssh.CALL_S and box.silence_s == 1
    for call in (lambda: box.run("true\n"), lambda: forward._pass_through(box, "exec hpc-ddp status /r/x\n")):
        said, took = _took(call)
        assert isinstance(said, UserError) and "was lost: said nothing for 1 s" in str(said), said
        assert took < 1 + ssh.DRAIN_S + 4


def test_a_streamed_call_whose_child_keeps_the_pipes_ends_at_the_wall_clock_bound(short, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_ssh(short, HOLDS_PIPES)}:{os.environ['PATH']}")
    said, took = _took(lambda: forward._pass_through(_box(short, HPC_DDP_SSH_TIMEOUT_S="0.5"), "true\n"))
    assert isinstance(said, UserError) and "no answer within 0.5 s" in str(said) and took < 0.5 + ssh.DRAIN_S + 3


def test_a_streamed_answer_is_shown_whole_though_a_child_keeps_the_pipes(short, monkeypatch, capfd):
    body = "echo line one; echo line two >&2; sleep 30 & echo $! >> {pids}; exit 3"
    monkeypatch.setenv("PATH", f"{_fake_ssh(short, body)}:{os.environ['PATH']}")
    code, took = _took(lambda: forward._pass_through(_box(short), "true\n"))
    out, err = capfd.readouterr()
    assert code == 3 and out == "line one\n" and "line two" in err and took < ssh.DRAIN_S + 3


def test_status_of_a_host_run_dir_over_a_silent_ssh_is_one_line_with_exit_2(short, tmp_path):
    env = {**os.environ, "PATH": f"{_fake_ssh(short, HOLDS_PIPES)}:{os.environ['PATH']}",
           "HPC_DDP_SSH_SILENCE_S": "1", "HPC_DDP_SSH_CONTROL_DIR": str(short / "c"),
           "HPC_DDP_REGISTRY": str(tmp_path / "runs.jsonl")}
    for command in ("status", "cancel"):
        start = time.monotonic()
        done = subprocess.run([*CLI, command, "cluster:/scratch/me/run"], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2, done.stderr
        assert "the connection to cluster was lost: said nothing for 1 s" in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and time.monotonic() - start < 15


@pytest.mark.parametrize("value", ["abc", "0", "-5", "nan", "1e9"])
def test_the_silence_is_a_number_of_seconds(short, value):
    with pytest.raises(UserError, match="HPC_DDP_SSH_SILENCE_S=.* is not a number of seconds"):
        _box(short, HPC_DDP_SSH_SILENCE_S=value)


@pytest.mark.parametrize(("line", "minor", "ok"), [
    ("rsync  version 3.2.7  protocol version 31", 1, True), ("rsync  version 3.0.9  protocol version 30", 1, False),
    ("rsync  version 3.0.9  protocol version 30", 0, True), ("rsync version v3.4.1", 1, True),
    ("openrsync: protocol version 29", 0, False), (None, 0, False)])
def test_progress_and_its_silence_bound_only_where_both_rsyncs_are_3_1(line, minor, ok):
    assert _rsync_3(line, minor=minor) is ok
