"""`hpc-ddp attach` (debug.attach): the bridge it runs to reach a debug rank, what it says, and that it
joins a debugger's connection to the rank's relay and ends once the rank no longer waits."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid

from hpc_ddp.debug import attach
from hpc_ddp.job import debugrelay

CLUSTER = {"job_id": "55", "rank": 3, "node": "hpcn1", "slurm_job_id": "55", "python": "/venv/bin/python",
           "socket": "/tmp/hpc-ddp-1000/rank-55-3.sock", "login_socket": "/tmp/hpc-ddp-1000/attach-55-3.sock",
           "port": 5678, "loopback": False}


def test_a_cluster_rank_is_reached_through_srun_into_its_job_and_a_local_one_directly():
    assert attach.bridge_command(CLUSTER, "/venv/bin/python") == [
        "srun", "--jobid", "55", "--overlap", "-w", "hpcn1", "-N1", "-n1", "--quiet",
        "/venv/bin/python", "-m", "hpc_ddp.job.debugrelay", "bridge", "--", "/tmp/hpc-ddp-1000/rank-55-3.sock"]
    local = {**CLUSTER, "loopback": True, "login_socket": None}
    assert attach.bridge_command(local, "/venv/bin/python")[0] == "/venv/bin/python"
    assert attach.socket_path(local) == debugrelay.login_socket_path("55", 3)


def test_it_says_the_laptop_command_and_the_local_port():
    lines = attach.intro_lines(CLUSTER, CLUSTER["login_socket"], 5690, "login1")
    assert lines[1] == ("hpc-ddp: from your laptop: ssh -N -L 5678:/tmp/hpc-ddp-1000/attach-55-3.sock login1  then "
                        "attach VS Code or PyCharm to localhost:5678")
    assert lines[2] == "hpc-ddp: on this machine: attach VS Code or PyCharm to localhost:5690"
    assert f"for uid {os.getuid()} only" in lines[0]


def test_a_session_is_joined_to_the_rank_and_attach_ends_when_the_rank_no_longer_waits():
    job = f"attach-test-{uuid.uuid4().hex[:8]}"
    node_socket = debugrelay.node_socket_path(job, 0)
    event = {"job_id": job, "rank": 0, "node": "here", "python": sys.executable, "socket": node_socket,
             "loopback": True, "port": 5678}
    relay = debugrelay.listen_unix(node_socket)  # stands in for the rank's relay: it echoes, upper-cased

    def echo():
        conn, _ = relay.accept()
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data.upper())
    threading.Thread(target=echo, daemon=True).start()
    waits = {"now": True}
    said: list[str] = []
    server = threading.Thread(target=attach.serve, kwargs={
        "event": event, "port": None, "current": lambda: event if waits["now"] else None, "say": said.append,
        "poll_s": 0.2}, daemon=True)
    server.start()
    path = debugrelay.login_socket_path(job, 0)
    client = _wait_connect(path)
    with client:
        client.sendall(b"initialize")
        got = b""
        while len(got) < 10:
            got += client.recv(1024)
        assert got == b"INITIALIZE"
    waits["now"] = False
    server.join(10)
    relay.close()
    os.unlink(node_socket)
    assert not server.is_alive() and not os.path.exists(path)
    assert "hpc-ddp: a debugger attached" in said and said[-1].endswith("no longer waits for a debugger; attach ends")


def _wait_connect(path: str) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        try:
            sock.connect(path)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_sigterm_or_a_closed_terminal_ends_attach_with_its_socket_removed(tmp_path):
    """A killed attach used to leave its socket; the next attach of the same job id (job ids restart on a
    fresh controller) then looked served to anything that checked for the file."""
    import signal
    import subprocess

    from e2e.helpers import unix_listening

    for signum in (signal.SIGTERM, signal.SIGHUP):
        job = f"attach-term-{uuid.uuid4().hex[:8]}"
        path = debugrelay.login_socket_path(job, 0)
        child = subprocess.Popen([sys.executable, "-c", f"""
from hpc_ddp.cli.cmd_debug import _ends_like_ctrl_c
from hpc_ddp.debug import attach
import signal
event = {{"job_id": {job!r}, "rank": 0, "node": "here", "socket": "/nonexistent", "loopback": True}}
try:
    with _ends_like_ctrl_c(signal.SIGTERM, signal.SIGHUP):
        attach.serve(event, port=None, current=lambda: event, say=print, poll_s=0.2)
except KeyboardInterrupt:
    print("ended like ctrl-c")
"""], stdout=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 60
            while not unix_listening(path) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert unix_listening(path)
            child.send_signal(signum)
            out, _ = child.communicate(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
        assert child.returncode == 0 and "ended like ctrl-c" in out, out
        assert not os.path.exists(path)
