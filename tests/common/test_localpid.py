"""The local executor's pid file never names a stranger, its children die with it, a cancel is a state of
its own, and a stop signal ends the rendezvous wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpc_ddp.common.procs import ProcessIdentity, die_with_parent_preexec, read_pid_file, signal_process, write_pid_file
from hpc_ddp.job.attempts import current_job
from hpc_ddp.launch.executors.base import Run
from hpc_ddp.launch.executors.local import LocalExecutor
from hpc_ddp.watch.status import _overall_state


def _local_state(run_dir: Path) -> dict:
    return LocalExecutor().state(Run(run_dir, None, "local"))


def _sleep() -> subprocess.Popen:
    """`sleep 60`, once it has exec'd: until then /proc shows the forked Python, or an empty cmdline."""
    proc = subprocess.Popen(["sleep", "60"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"sleep"):
        time.sleep(0.01)
    return proc


@pytest.fixture
def sleeper():
    proc = _sleep()
    yield proc
    proc.kill()
    proc.wait()


def test_this_process_is_identified_and_trusted(tmp_path):
    me = ProcessIdentity.of(os.getpid())
    assert me is not None and me.alive() and me.start.isdigit()
    write_pid_file(tmp_path / "local.pid", "local-1-2")
    who, tag, why = read_pid_file(tmp_path / "local.pid")
    assert who == me and tag == "local-1-2" and why == "running"
    assert _local_state(tmp_path) == {"state": "RUNNING", "source": "local", "pid": os.getpid()}


def test_a_name_with_spaces_and_parens_does_not_shift_the_fields(tmp_path):
    exe = tmp_path / "a b) (c"
    os.symlink("/bin/sleep", exe)
    proc = subprocess.Popen([str(exe), "60"])
    try:
        time.sleep(0.2)
        who = ProcessIdentity.of(proc.pid)
        assert who is not None and who.start == ProcessIdentity.of(proc.pid).start and who.alive()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("text", [
    "{pid} local-1-2",                                   # an older hpc-ddp: no start time
    "{pid} local-1-2 {start} {boot} 0123456789abcdef",   # the pid, started then, but another program
    "{pid} local-1-2 1 {boot} {cmd}",                    # the pid, another start: recycled
    "{pid} local-1-2 {start} another-boot {cmd}",        # before a reboot
    "{pid} local-1-2 - - -",
    "not-a-pid", "", "\x00\x01",
])
def test_a_pid_file_that_does_not_name_that_very_process_is_not_trusted(tmp_path, sleeper, text):
    real = ProcessIdentity.of(sleeper.pid)
    (tmp_path / "local.pid").write_text(text.format(pid=sleeper.pid, start=real.start, boot=real.boot, cmd=real.cmdline))
    who, _, why = read_pid_file(tmp_path / "local.pid")
    assert who is None and why != "running"
    assert _local_state(tmp_path) == {}


def test_the_pid_file_of_a_process_that_is_gone_is_not_trusted(tmp_path):
    proc = _sleep()
    who = ProcessIdentity.of(proc.pid)
    (tmp_path / "local.pid").write_text(f"{proc.pid} j {who.start} {who.boot} {who.cmdline}\n")
    assert read_pid_file(tmp_path / "local.pid")[0] == who
    proc.kill()
    time.sleep(0.2)  # a zombie (not reaped yet) is not running either
    assert read_pid_file(tmp_path / "local.pid")[0] is None
    proc.wait()
    assert read_pid_file(tmp_path / "local.pid")[0] is None
    assert read_pid_file(tmp_path / "missing.pid") == (None, None, "no pid file")


def test_signal_process_refuses_another_process_with_the_pid(sleeper):
    real = ProcessIdentity.of(sleeper.pid)
    impostor = ProcessIdentity(sleeper.pid, str(int(real.start) + 1), real.boot, real.cmdline)
    assert not signal_process(impostor, signal.SIGTERM)
    time.sleep(0.2)
    assert sleeper.poll() is None
    assert signal_process(real, signal.SIGTERM)
    assert sleeper.wait(timeout=5) == -signal.SIGTERM


def test_children_die_with_a_sigkilled_parent(tmp_path):
    """A parent in a session of its own starts a child in another (as the executor starts ranks), and is
    SIGKILLed: the child goes with it."""
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        from hpc_ddp.common.procs import die_with_parent_preexec
        child = subprocess.Popen(["sleep", "60"], start_new_session=True, preexec_fn=die_with_parent_preexec())
        open({str(tmp_path / 'child')!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)])
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "child").exists() or not (tmp_path / "child").read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = int((tmp_path / "child").read_text())
        assert ProcessIdentity.of(child) is not None
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while ProcessIdentity.of(child) is not None:
            assert time.monotonic() < deadline, "the child outlived its SIGKILLed parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()


def test_the_preexec_is_built_in_the_parent():
    assert callable(die_with_parent_preexec())


# ---- state ----

def _start(job, attempt=0):
    return {"event": "attempt_start", "attempt": attempt, "job_id": job}


CANCEL = [{"event": "attempt_end", "attempt": 0, "exit_code": 75, "cause": "cancelled"},
          {"event": "gave_up", "attempt": 0, "reason": "cancelled by the user", "cause": "cancelled"}]


@pytest.mark.parametrize("events, state", [
    ([_start("a"), {"event": "start"}, *CANCEL], "CANCELLED"),
    # cancelled in the gap between two attempts: no attempt_end of its own
    ([_start("a"), {"event": "attempt_end", "attempt": 0, "exit_code": 75, "cause": "preempted"},
      {"event": "requeue"}, {"event": "gave_up", "attempt": 1, "reason": "cancelled by the user", "cause": "cancelled"}],
     "CANCELLED"),
    # cancelled, then submitted again to resume: the new job is judged on its own
    ([_start("a"), *CANCEL, _start("b"), {"event": "resume"}, {"event": "finish"},
      {"event": "attempt_end", "attempt": 0, "exit_code": 0, "cause": "completed"}], "COMPLETED"),
    ([_start("a"), {"event": "gave_up", "reason": "max_preemptions"}, _start("b"), {"event": "resume"}], "ENDED"),
    # a `cancelled` record alone (the job finished as the cancel came) is not a cancel
    ([_start("a"), {"event": "cancelled", "job_id": "a"}, {"event": "finish"},
      {"event": "attempt_end", "attempt": 0, "exit_code": 0}], "COMPLETED"),
])
def test_overall_state(events, state):
    current = current_job(events)
    gave_up = next((e["reason"] for e in reversed(current) if e.get("event") == "gave_up"), None)
    assert _overall_state({}, current, gave_up) == state


def test_a_live_executor_is_running_whatever_the_events_say():
    assert _overall_state({"state": "RUNNING"}, [_start("a"), *CANCEL], "cancelled by the user") == "RUNNING"


# ---- the rendezvous stops on a stop signal ----

def test_a_stop_ends_the_rendezvous_wait_at_once():
    from hpc_ddp.job.ports import first_free_port
    from hpc_ddp.trainer.rendezvous import RendezvousStopped, join

    env = _env(first_free_port(29650))
    asked = time.monotonic() + 0.5
    started = time.monotonic()
    with pytest.raises(RendezvousStopped, match="stopped by a stop request while the ranks were meeting") as info:
        join(env, timeout_s=60, host="h", stop=lambda: time.monotonic() > asked)
    assert time.monotonic() - started < 5 and info.value.exit_code == 128 + signal.SIGTERM


def test_sigterm_ends_the_rendezvous_wait_and_still_reaches_the_stop_flag():
    from hpc_ddp.job.ports import first_free_port
    from hpc_ddp.trainer.rendezvous import RendezvousStopped, join
    from hpc_ddp.trainer.stopping import StopFlag

    flag = StopFlag(("USR2", "TERM")).install()
    try:
        env = _env(first_free_port(29670))
        timer = __import__("threading").Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        started = time.monotonic()
        with pytest.raises(RendezvousStopped, match="stopped by SIGTERM"):
            join(env, timeout_s=60, host="h")
        assert time.monotonic() - started < 5
        assert flag.received == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) == flag._handle  # the join's wrapper is gone
    finally:
        flag.uninstall()


def _env(port: int):
    from hpc_ddp.job.distenv import DistEnv

    return DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=1, node_rank=0, num_nodes=2,
                   master_addr="127.0.0.1", master_port=port, hosts=("h", "h2"), job_id="t", restart_count=0,
                   source="test")
