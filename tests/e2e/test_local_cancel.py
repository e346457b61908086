"""Cancel means cancel on the local executor: `hpc-ddp cancel` and Ctrl-C stop a job for good (CANCELLED,
after the ranks checkpoint), a second Ctrl-C stops it at once, a stale local.pid never gets a stranger
signalled, the ranks die with a SIGKILLed executor, and a stop signal ends a rendezvous that waits for a
rank that never comes in seconds. Small jobs (2 ranks), mostly plain scripts: no torch where none is needed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl

from .helpers import hpc_ddp, last_step, wait_until

pytestmark = pytest.mark.e2e

# A user's program that checkpoints on SIGTERM and asks to be requeued (the trainer's protocol).
# SAVE_S: how long its "save" takes (while a file `hold` is in its folder: until it is gone, SAVE_S at most);
# IGNORE_TERM: it never stops on SIGTERM.
SCRIPT = """
import os, signal, sys, time
from pathlib import Path
rank = os.environ["RANK"]
def stop(*_):
    if os.environ.get("IGNORE_TERM"):
        return
    deadline = time.monotonic() + float(os.environ.get("SAVE_S", "0"))
    held = Path("hold").exists()
    while time.monotonic() < deadline and (not held or Path("hold").exists()):
        time.sleep(0.05)
    Path(f"saved-{rank}-{os.environ['HPC_DDP_RESTART_COUNT']}").write_text("x")
    sys.exit(75)
signal.signal(signal.SIGTERM, stop)
Path(f"pid-{rank}").write_text(str(os.getpid()))
time.sleep(float(os.environ.get("RUN_S", "600")))
"""

TRAIN = """nodes = 1
tasks_per_node = 2
[train]
dataset = "fake"
fake_size = {size}
image_size = 8
model = "mlp"
epochs = {epochs}
batch_size = 8
num_workers = 0
log_every = 1
eval_every_epoch = false
"""


@pytest.fixture
def ws(tmp_path):
    (tmp_path / "job.py").write_text(SCRIPT)
    (tmp_path / "long.toml").write_text(TRAIN.format(size=4096, epochs=200))
    (tmp_path / "short.toml").write_text(TRAIN.format(size=64, epochs=1))
    return tmp_path


def _start(ws: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`hpc-ddp submit --executor local` in the background, in a session of its own: a terminal's Ctrl-C
    is a SIGINT to that whole foreground group (the ranks are in sessions of their own)."""
    return subprocess.Popen([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", *args], cwd=ws,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


def _ctrl_c(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)


def _finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, float]:
    started = time.monotonic()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_all(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"the executor did not end within {timeout} s:\n{out[-3000:]}") from None
    return proc.returncode, out, time.monotonic() - started


def _kill_all(proc: subprocess.Popen) -> None:
    for pid in [*_ranks(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _ranks(pid: int) -> list[int]:
    """The executor's children (the ranks: the runner execs the program, so they stay its children)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _status(ws: Path, run: str) -> dict:
    done = hpc_ddp("status", "--json", run, cwd=ws)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _script_ranks_up(ws: Path, n: int = 2) -> None:
    wait_until(lambda: all((ws / f"pid-{r}").exists() for r in range(n)), 60, "the ranks to start")


def _in_rendezvous(proc: subprocess.Popen) -> bool:
    """Rank 0 listens on MASTER_PORT: it is in the rendezvous, waiting for the others."""
    for pid in _ranks(proc.pid):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if env.get("RANK") == "0":
            try:
                socket.create_connection(("127.0.0.1", int(env["MASTER_PORT"])), timeout=1).close()
                return True
            except OSError:
                return False
    return False


def _finished_run(ws: Path, name: str = "done") -> Path:
    done = hpc_ddp("submit", "--executor", "local", "--nodes", "1", "--tasks-per-node", "2", "--run-dir", name,
                   "job.py", cwd=ws, env={"RUN_S": "0"}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return ws / name


# ---- cancel and Ctrl-C stop the job for good ----

@pytest.mark.parametrize("how", ["cancel", "ctrl-c"])
def test_a_cancelled_training_checkpoints_and_is_not_restarted(ws, how):
    proc = _start(ws, "--run-dir", "run", "long.toml")
    try:
        wait_until(lambda: last_step(ws / "run") >= 3, 120, "a few training steps")
        if how == "cancel":
            done = hpc_ddp("cancel", "run", cwd=ws, timeout=120)
            assert done.returncode == 0 and "Cancelled job" in done.stdout, done.stdout + done.stderr
        else:
            _ctrl_c(proc)
        rc, out, took = _finish(proc, 90)
    finally:
        _kill_all(proc)
    assert rc == 130 and "cancelled" in out and "restarting" not in out, out[-3000:]
    status = _status(ws, "run")
    assert status["state"] == "CANCELLED", status
    assert [a["ended"] for a in status["attempts"]] == ["cancelled"], status["attempts"]
    assert status["last_checkpoint_step"] is not None and status["last_checkpoint_step"] >= 3  # it saved first
    assert not (ws / "run" / "local.pid").exists()
    if how == "cancel":  # the rank's own line calls it a cancel, not a preemption (issue 42, item 14)
        stops = [line for line in out.splitlines() if "stop requested" in line]
        assert stops and all("cancelled" in line and "preempted" not in line for line in stops), stops


def test_a_second_ctrl_c_stops_ranks_that_do_not_stop(ws):
    proc = _start(ws, "--nodes", "1", "--tasks-per-node", "2", "--run-dir", "run", "job.py",
                  env={"IGNORE_TERM": "1"})
    try:
        _script_ranks_up(ws)
        pids = [int((ws / f"pid-{r}").read_text()) for r in range(2)]
        _ctrl_c(proc)
        time.sleep(1.5)
        assert all(_alive(p) for p in pids)  # the first one asks; they may take their time to save
        _ctrl_c(proc)
        rc, out, took = _finish(proc, 15)
    finally:
        _kill_all(proc)
    assert rc == 130 and took < 10, (took, out[-3000:])
    assert not any(_alive(p) for p in pids)
    assert _status(ws, "run")["state"] == "CANCELLED"


def test_cancel_twice_waits_for_the_checkpoint_instead_of_killing_it(ws):
    # The save lasts until the second cancel has had its answer (a fixed 3 s save ended before a second cancel
    # slowed by a CPU-starved machine came: "no local job is running").
    hold = ws / "hold"
    hold.write_text("")
    proc = _start(ws, "--nodes", "1", "--tasks-per-node", "2", "--run-dir", "run", "job.py",
                  env={"SAVE_S": "60"})
    try:
        _script_ranks_up(ws)
        first = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "cancel", "run"], cwd=ws, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        wait_until(lambda: any(e.get("event") == "cancelled" for e in read_jsonl(ws / "run" / "events.jsonl")), 30,
                   "the first cancel")
        # The second cancel says it waits, then waits for the save: the save ends once it has said so.
        second = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "cancel", "run"], cwd=ws, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        said = second.stderr.readline()   # its first line, or "" if it ended without one
        hold.unlink()
        out2, err2 = second.communicate(timeout=60)
        assert second.returncode == 0 and "already being cancelled" in said, said + out2 + err2
        assert first.wait(timeout=60) == 0, first.stdout.read()
        rc, out, _ = _finish(proc, 30)
    finally:
        _kill_all(proc)
    assert rc == 130, out[-3000:]
    assert sorted(p.name for p in ws.glob("saved-*")) == ["saved-0-0", "saved-1-0"], out[-3000:]  # both finished saving
    assert _status(ws, "run")["state"] == "CANCELLED"


def test_cancel_of_a_finished_run_says_it_is_not_running(ws):
    run = _finished_run(ws)
    for args in (["cancel", str(run)], ["preempt", str(run)]):
        done = hpc_ddp(*args, cwd=ws)
        assert done.returncode == 2 and done.stderr.startswith("hpc-ddp: error: no local job is running"), done
        assert len(done.stderr.strip().splitlines()) == 1
    assert _status(ws, str(run))["state"] == "COMPLETED"


# ---- a stale local.pid never gets a stranger signalled ----

@pytest.mark.parametrize("command", ["cancel", "preempt"])
@pytest.mark.parametrize("pid_file", ["old-format", "same-pid-other-start", "garbage"])
def test_a_stale_pid_file_never_signals_the_process_that_took_the_pid(ws, command, pid_file):
    run = _finished_run(ws, f"stale-{command}-{pid_file}")
    stranger = subprocess.Popen(["sleep", "60"])  # took the pid of an executor that was SIGKILLed
    try:
        fields = {"old-format": f"{stranger.pid} local-1-2",
                  "same-pid-other-start": f"{stranger.pid} local-1-2 12 bootid 0123456789abcdef",
                  "garbage": "\x00 not a pid"}[pid_file]
        (run / "local.pid").write_text(fields + "\n")
        done = hpc_ddp(command, str(run), cwd=ws)
        assert done.returncode == 2 and "no local job is running" in done.stderr, done.stdout + done.stderr
        time.sleep(0.3)
        assert stranger.poll() is None, "the stranger was signalled"
        assert _status(ws, str(run))["state"] == "COMPLETED"  # not RUNNING: the pid is not ours
    finally:
        stranger.kill()
        stranger.wait()


# ---- the ranks die with the executor ----

def test_the_ranks_die_with_a_sigkilled_executor(ws):
    proc = _start(ws, "--nodes", "1", "--tasks-per-node", "2", "--run-dir", "run", "job.py")
    try:
        _script_ranks_up(ws)
        pids = [int((ws / f"pid-{r}").read_text()) for r in range(2)]
        proc.kill()
        proc.wait()
        wait_until(lambda: not any(_alive(p) for p in pids), 5, "the ranks to die with the executor")
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert _status(ws, "run")["state"] != "RUNNING"  # local.pid is left behind, naming a dead process
    assert hpc_ddp("cancel", "run", cwd=ws).returncode == 2


# ---- a stop signal ends a rendezvous that waits for a rank that never comes ----

def test_a_cancel_while_a_rank_never_joins_ends_the_job_in_seconds(ws):
    proc = _start(ws, "--rendezvous-timeout", "60", "--run-dir", "nojoin", "short.toml",
                  env={"HPC_DDP_FAULT_NO_JOIN": "1"})
    try:
        wait_until(lambda: _in_rendezvous(proc), 60, "rank 0 to wait in the rendezvous")
        time.sleep(0.5)
        started = time.monotonic()
        assert hpc_ddp("cancel", "nojoin", cwd=ws, timeout=60).returncode == 0
        rc, out, _ = _finish(proc, 60)
        took = time.monotonic() - started
    finally:
        _kill_all(proc)
    # Well before the 60 s rendezvous timeout it must not wait for; 8 s ran out once (12.6) on a loaded machine
    assert rc == 130 and took < 30, (took, out[-3000:])
    assert "stopped by SIGTERM while the ranks were meeting" in out, out[-3000:]
    assert _status(ws, "nojoin")["state"] == "CANCELLED"


def test_a_sigterm_while_a_rank_never_joins_ends_that_attempt_in_seconds(ws):
    """SIGTERM to the local executor rehearses a preemption: the waiting attempt ends at once (not after the
    rendezvous timeout) and, as on Slurm, a preempted attempt runs again; a cancel then ends the job."""
    proc = _start(ws, "--rendezvous-timeout", "60", "--run-dir", "nojoin-term", "short.toml",
                  env={"HPC_DDP_FAULT_NO_JOIN": "1"})
    try:
        wait_until(lambda: _in_rendezvous(proc), 60, "rank 0 to wait in the rendezvous")
        time.sleep(0.5)
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        ends = lambda: [e for e in read_jsonl(ws / "nojoin-term" / "events.jsonl") if e["event"] == "attempt_end"]  # noqa: E731
        wait_until(ends, 30, "attempt 0 to end")
        first = ends()[0]
        assert first["cause"] == "preempted" and first["time"] - sent < 8, first
        wait_until(lambda: _in_rendezvous(proc), 60, "attempt 1 to wait in the rendezvous")
        assert hpc_ddp("cancel", "nojoin-term", cwd=ws, timeout=60).returncode == 0
        _finish(proc, 60)
    finally:
        _kill_all(proc)
    assert _status(ws, "nojoin-term")["state"] == "CANCELLED"


# ---- Ctrl-C in the gap between two attempts ----

def test_ctrl_c_between_two_attempts_starts_no_other(ws, monkeypatch):
    """The SIGINT arrives just after attempt 0 ended and its requeue was decided (in-process, so the
    moment is exact)."""
    from hpc_ddp.common.procs import FakeCommands
    from hpc_ddp.job import attempts
    from hpc_ddp.launch.executors import local
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec
    from hpc_ddp.watch.status import run_status

    monkeypatch.chdir(ws)
    spec = build_spec([Layer("t", {"nodes": 1, "tasks_per_node": 2})], target=Target("script", str(ws / "job.py")),
                      workdir=str(ws), python=sys.executable)
    real_end = attempts.end

    def end_then_ctrl_c(run_dir, attempt, rc, env=None):
        real_end(run_dir, attempt, rc, env)
        os.kill(os.getpid(), signal.SIGINT)
        return True, "preempted: requeue 1 of at most 20"

    monkeypatch.setattr(local.attempts, "end", end_then_ctrl_c)
    monkeypatch.setenv("RUN_S", "0")
    executor = local.LocalExecutor(echo=False)
    try:
        sub = executor.submit(executor.plan(spec, str(ws / "gap")))
    except KeyboardInterrupt:
        sub = None
    events = read_jsonl(ws / "gap" / "events.jsonl")
    assert [e["attempt"] for e in events if e["event"] == "attempt_start"] == [0], events
    assert sub is not None and sub.state == "CANCELLED", sub
    assert run_status(ws / "gap", sub.job_id, "local", FakeCommands())["state"] == "CANCELLED"
