"""--debug-rank: a real debugger (a DAP client, as VS Code is) attaches to rank 1 of a 2 x 2 local job, stops at
a breakpoint, reads a variable, continues, and the job completes: the other ranks waited for it."""

from __future__ import annotations

import json
import os
import pty
import socket
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl

from .dap import DapClient
from .helpers import hpc_ddp, stop, wait_for_job, wait_until

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


@pytest.mark.extended
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
            shown = subprocess.run([sys.executable, "-m", "hpc_ddp", "status", str(run_dir)], capture_output=True,
                                   text=True, timeout=60).stdout
            assert f"rank 1 waits for debugpy on 127.0.0.1:{event['port']}" in shown, shown
            assert "collective 86400 s" in shown and f"ssh -N -L {event['port']}:127.0.0.1:{event['port']}" in shown
            assert proc.poll() is None  # the others sat in the all-reduce meanwhile
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


def _connect(port: int, host: str = "127.0.0.1") -> DapClient | None:
    try:
        return DapClient(host, port)
    except OSError:
        return None



def test_pdb_on_rank_1_reads_the_terminal(tmp_path):
    """--pdb: rank 1's pdb reads this process's stdin (a terminal: a pseudo-terminal here); the other ranks'
    output is still shown, prefixed, and the job completes."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    line = next(i for i, x in enumerate(SCRIPT.splitlines(), 1) if "# BREAK" in x)
    # After the program ends `python -m pdb` offers to restart it: q ends it there.
    commands = f"b {line}\nc\np secret * 100\nc\nq\n"
    terminal, stdin = pty.openpty()
    attrs = termios.tcgetattr(stdin)
    attrs[3] &= ~termios.ECHO  # what is typed is not echoed back into the terminal's output, unread here
    termios.tcsetattr(stdin, termios.TCSANOW, attrs)
    os.write(terminal, commands.encode())  # typed ahead: the terminal holds it until pdb reads
    try:
        done = subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--nodes", "2",
                               "--tasks-per-node", "2", "--debug-rank", "1", "--pdb", "--run-dir", "run",
                               str(script)], cwd=tmp_path, stdin=stdin, capture_output=True, text=True, timeout=90)
    finally:
        os.close(stdin)
        os.close(terminal)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(Pdb) 800" in done.stdout  # rank 1's secret, 8, printed by pdb itself
    assert "[rank 0] total=46" in done.stdout and "[rank 3] total=46" in done.stdout
    assert "rank 1 runs under pdb" in done.stdout
    log = next((tmp_path / "run").glob("logs/job-local-*/attempt-0/rank-1.log")).read_text()
    assert "ran under pdb" in log


def test_a_taken_debug_port_is_refused_before_anything_runs(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--debug-rank", "0",
                               "--debug-port", str(port), "--run-dir", "run", str(script)],
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"--debug-port {port} is already in use on this machine" in done.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slurm
def test_attach_to_rank_3_of_a_2x2_job_on_the_test_slurm(slurm_conf, tmp_path):
    """On a cluster the debug rank (on hpcn2 here) is reached through `hpc-ddp attach JOB` on the submit host,
    which relays through srun into the job; the client attaches to the socket attach serves, as a laptop
    does through `ssh -L PORT:SOCKET`."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    line = next(i for i, x in enumerate(SCRIPT.splitlines(), 1) if "# BREAK" in x)
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", "--executor", "sbatch", "--nodes", "2", "--gpus", "2", "--debug-rank", "3",
                   "--run-dir", str(run_dir), "--json", str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = json.loads(done.stdout[done.stdout.index("{"):])["job_id"]
    attach = None
    try:
        event = wait_until(lambda: _debugger_event(run_dir), 120, "the debugger event")
        assert event["node"] == "hpcn2" and event["attach"] == f"hpc-ddp attach {job_id}"
        assert event["tunnel"] == f"ssh -N -L 5678:{event['login_socket']} {socket.gethostname()}"
        attach = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "attach", job_id], cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        client = wait_until(lambda: _connect_unix(event["login_socket"]), 30, "hpc-ddp attach serving")
        try:
            stopped = client.attach_and_break(str(script), line)
            assert client.local_variable(stopped["body"]["threadId"], "secret") == "22"  # rank 3: 3 * 7 + 1
            client.request("continue", threadId=stopped["body"]["threadId"])
        finally:
            client.close()
        assert wait_for_job(job_id, timeout=120) == "COMPLETED"
        _, said = attach.communicate(timeout=60)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        stop(attach)
    assert f"ssh -N -L 5678:{event['login_socket']}" in said and "a debugger attached" in said, said
    logs = [p.read_text() for p in sorted(run_dir.glob(f"logs/job-{job_id}/attempt-0/rank-*.log"))]
    assert all("total=46" in log for log in logs), logs
    assert f"hpc-ddp: on the login node run: hpc-ddp attach {job_id}" in logs[3]
    assert f"hpc-ddp: then from your laptop: {event['tunnel']}" in logs[3]


def _connect_unix(path: str) -> DapClient | None:
    try:
        return DapClient.unix(path)
    except OSError:
        return None


def test_the_warning_signal_still_checkpoints_a_job_with_a_rank_in_the_debugger(tmp_path):
    """Rank 1 stopped at a breakpoint when the warning signal comes (hpc-ddp preempt): once the debugger lets it
    go, every rank checkpoints and the attempt ends resumable (exit 75); the local executor then starts the next
    attempt, whose rank 1 waits for the debugger again."""
    script = tmp_path / "job.py"
    script.write_text((Path(__file__).parents[2] / "examples" / "linear_regression.py").read_text())
    line = next(i for i, x in enumerate(script.read_text().splitlines(), 1) if "run.step(loss)" in x)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--nodes", "1",
                             "--tasks-per-node", "2", "--epochs", "100000", "--debug-rank", "1", "--run-dir",
                             str(run_dir), str(script)], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        event = wait_until(lambda: _debugger_event(run_dir), 60, "the debugger event")
        client = wait_until(lambda: _connect(event["port"]), 30, "debugpy listening")
        try:
            stopped = client.attach_and_break(str(script), line)
            preempt = hpc_ddp("preempt", str(run_dir), cwd=tmp_path)
            assert preempt.returncode == 0, preempt.stderr
            client.request("setBreakpoints", source={"path": str(script)}, breakpoints=[])
            client.request("continue", threadId=stopped["body"]["threadId"])
            ended = wait_until(lambda: next((e for e in read_jsonl(run_dir / "events.jsonl")
                                             if e["event"] == "attempt_end"), None), 90, "the attempt's end")
        finally:
            client.close()
    finally:
        proc.kill()  # the next attempt's rank 1 waits for a debugger; the ranks die with the executor
        proc.wait(timeout=30)
    assert ended["exit_code"] == 75, ended
    assert (run_dir / "checkpoints" / "latest").exists()


LOOP = """\
import time
step = 0
while step < 600:
    step += 1
    time.sleep(0.1)  # BREAK
print(f"looped to {step}", flush=True)
"""


def test_a_debugger_may_detach_and_another_attach_later(tmp_path):
    """The first debugger attaches on the loopback port and detaches (the rank runs on); a second one comes
    through `hpc-ddp attach`'s socket, stops the rank again, and lets it finish."""
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    line = next(i for i, x in enumerate(LOOP.splitlines(), 1) if "# BREAK" in x)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--debug-rank", "0",
                             "--run-dir", str(run_dir), str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    attach = None
    try:
        event = wait_until(lambda: _debugger_event(run_dir), 60, "the debugger event")
        first = wait_until(lambda: _connect(event["port"]), 30, "the relay")
        with first.sock:
            stopped = first.attach_and_break(str(script), line)
            step = int(first.local_variable(stopped["body"]["threadId"], "step"))
            first.request("disconnect")
        attach = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "attach", str(run_dir)], cwd=tmp_path,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        second = wait_until(lambda: _connect_unix(_login_socket(event)), 30, "hpc-ddp attach serving")
        with second.sock:
            stopped = second.attach_and_break(str(script), line)
            thread = stopped["body"]["threadId"]
            assert int(second.local_variable(thread, "step")) > step  # it ran on meanwhile
            frame = second.request("stackTrace", threadId=thread)["body"]["stackFrames"][0]["id"]
            second.request("evaluate", expression="step = 1000", frameId=frame, context="repl")  # end the loop
            second.request("setBreakpoints", source={"path": str(script)}, breakpoints=[])
            second.request("continue", threadId=thread)
            out, err = proc.communicate(timeout=90)
    finally:
        for child in (proc, attach):
            stop(child)
    assert proc.returncode == 0 and "looped to 1000" in out, out + err


def _login_socket(event) -> str:
    from hpc_ddp.job.debugrelay import login_socket_path

    return login_socket_path(event["job_id"], event["rank"])
