"""hpc-ddp kills process groups (issue 30, leaks): a command run under `procs.Supervised` (each local rank,
each node's setup, each notebook rank) takes everything it started with it when it ends, when it is stopped,
and when the process that started it is SIGKILLed; a process that moved to a session of its own too. Each
command notes the pids of what it started in a file; a test then checks those pids are gone (not zombies)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpc_ddp.common.procs import Supervised

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the supervisor is Linux's")

# Bash that starts three kinds of leftovers, notes their pids in $PIDS, then does "$@":
# a child in its group, one that moved to a session of its own (setsid), and a double-forked daemon.
LEAVES = textwrap.dedent("""
    sleep 1000 & echo $! >> "$PIDS"
    setsid sleep 1000 & echo $! >> "$PIDS"
    ( setsid sh -c 'echo $$ >> "$PIDS"; exec sleep 1000' & ) ; sleep 0.2
    echo ready >> "$PIDS.ready"
""")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def noted(path: Path) -> list[int]:
    return [int(word) for word in path.read_text().split()] if path.exists() else []


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def pids(tmp_path):
    path = tmp_path / "pids"
    yield path
    for pid in noted(path):  # never leave a test's sleeper behind, whatever happened
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def leaver(pids: Path, then: str, grace: float = 2.0) -> Supervised:
    return Supervised(["bash", "-c", LEAVES + then], grace=grace, env={**os.environ, "PIDS": str(pids)})


@pytest.mark.parametrize("then, code", [("exit 0", 0), ("exit 3", 3), ("kill -KILL $$", -9)])
def test_what_a_command_started_ends_with_it(pids, then, code):
    started = time.monotonic()
    proc = leaver(pids, then)
    assert proc.wait(timeout=20) == code  # the command's own status, a signal's death included
    left = noted(pids)
    assert len(left) == 3 and not [p for p in left if alive(p)], left
    assert time.monotonic() - started < 5  # SIGTERM was enough: no grace waited out


def test_leftovers_deaf_to_sigterm_are_killed_after_the_grace(pids):
    proc = leaver(pids, "trap '' TERM; (trap '' TERM; exec setsid sleep 1000) & echo $! >> \"$PIDS\"; exit 0",
                  grace=0.5)
    assert proc.wait(timeout=20) == 0
    assert not [p for p in noted(pids) if alive(p)]


def test_kill_group_reaches_what_left_the_group(pids):
    proc = leaver(pids, "trap '' TERM; sleep 1000")
    wait_for(lambda: Path(f"{pids}.ready").exists(), 10, "the command to start its children")
    started = time.monotonic()
    assert proc.stop(grace=0.5) == -signal.SIGKILL  # deaf to SIGTERM: killed
    assert not [p for p in noted(pids) if alive(p)]
    assert time.monotonic() - started < 5


def test_kill_group_asked_twice_never_kills_the_supervisor_before_its_work(pids):
    """A second kill_group (a cancel's KILL_WAIT_S check runs every tick) must not SIGKILL the supervisor:
    what left the group would then be orphaned, nobody's to kill."""
    proc = leaver(pids, "sleep 1000")
    wait_for(lambda: Path(f"{pids}.ready").exists(), 10, "the command to start its children")
    for _ in range(5):
        proc.kill_group()
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert not [p for p in noted(pids) if alive(p)]


def test_the_group_gets_the_signal_and_the_supervisor_lets_it_pass(tmp_path):
    mark = tmp_path / "got-usr1"
    proc = Supervised([sys.executable, "-c", textwrap.dedent(f"""
        import signal, sys, time
        signal.signal(signal.SIGUSR1, lambda *_: (open({str(mark)!r}, "w").close(), sys.exit(0)))
        open({str(tmp_path / 'up')!r}, "w").close()
        time.sleep(60)
    """)], grace=1)
    wait_for(lambda: (tmp_path / "up").exists(), 10, "the command to start")
    proc.signal_group(signal.SIGUSR1)
    assert proc.wait(timeout=10) == 0 and mark.exists()


def test_everything_dies_with_a_sigkilled_parent(tmp_path, pids):
    """The parent (as hpc-ddp, or a notebook kernel) is SIGKILLed: nobody can ask for anything, yet the
    command and all it started, the escaped ones too, are gone within the grace."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        from hpc_ddp.common.procs import Supervised
        proc = Supervised(["bash", "-c", sys.argv[1] + 'echo $$ >> "$PIDS"; sleep 1000'], grace=1.0,
                          env={{**os.environ, "PIDS": {str(pids)!r}}})
        time.sleep(60)
    """), LEAVES])
    try:
        wait_for(lambda: len(noted(pids)) == 4, 20, "the command and its children")
        assert all(alive(p) for p in noted(pids))
        parent.kill()
        parent.wait()
        wait_for(lambda: not any(alive(p) for p in noted(pids)), 5, "everything to die with the parent")
    finally:
        parent.kill()
        parent.wait()


def test_the_environment_is_the_commands_exactly():
    """The supervisor is a Python (which sets LC_CTYPE where the locale is C): the command sees the given env."""
    for env in ({"PATH": os.environ["PATH"], "ONLY": "this"}, {"PATH": os.environ["PATH"], "LC_CTYPE": "C"}):
        proc = Supervised(["env"], grace=1, env=env, stdout=subprocess.PIPE)
        out, _ = proc.communicate(timeout=20)
        assert dict(line.split("=", 1) for line in out.decode().splitlines()) == env


@pytest.mark.parametrize("argv, code", [(["/nonexistent/program"], 127), (["/etc/hostname"], 126)])
def test_a_command_that_cannot_run_says_so(argv, code):
    proc = Supervised(argv, grace=1, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == code and err.decode().startswith(f"hpc-ddp: cannot run {argv[0]}: ")


def test_where_no_supervisor_can_run_the_command_is_a_plain_session(monkeypatch, tmp_path):
    """(a zipped install, no interpreter path, not Linux): still its own group, signalled and killed as one."""
    from hpc_ddp.common import procs

    monkeypatch.setattr(procs, "can_supervise", lambda: False)
    assert Supervised(["sh", "-c", "exit 3"], grace=1).wait(timeout=10) == 3
    argv = ["sh", "-c", f"trap '' TERM; touch {tmp_path / 'up'}; sleep 1000"]
    proc = Supervised(argv, grace=1)
    assert os.getpgid(proc.pid) == proc.pid and proc.args == argv  # no supervisor: the command leads the group
    wait_for(lambda: (tmp_path / "up").exists(), 10, "the command to start")
    assert proc.stop(grace=0.3) == -signal.SIGKILL
