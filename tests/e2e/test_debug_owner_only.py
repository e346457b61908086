"""--debug-rank: only the job's owner can reach the debug rank's debugger (issue 30, "the debug port").

Another Unix user on the same machine (`hpcremote`, which tests/cluster/sshd-up.sh creates) tries every TCP
port the job's processes listen on and every debug socket, and sends a DAP `initialize` where it gets in: it
never gets a DAP answer. The owner then attaches through the documented path (`hpc-ddp attach`, and the
loopback port of the local executor), stops at a breakpoint, and the program runs to its end. On the test
Slurm, that user cannot even start the srun step `hpc-ddp attach` relays through.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.common.events import read_jsonl
from hpc_ddp.job import debugrelay

from .dap import DapClient
from .helpers import hpc_ddp, stop, unix_listening, wait_for_job, wait_until

pytestmark = pytest.mark.e2e
pytest.importorskip("debugpy")

OTHER = "hpcremote"

SCRIPT = """\
secret = 6 * 7
print(f"secret={secret}", flush=True)  # BREAK
"""

# Run as the other user, with the system's Python (stdlib only): what it gets from each port and socket.
PROBE = r"""
import json, socket, sys
ports, paths = json.loads(sys.argv[1]), json.loads(sys.argv[2])
body = json.dumps({"seq": 1, "type": "request", "command": "initialize",
                   "arguments": {"adapterID": "debugpy", "clientID": "intruder"}}).encode()
message = b"Content-Length: %d\r\n\r\n" % len(body) + body

def attempt(connect):
    try:
        sock = connect()
    except OSError as exc:
        return "refused: " + (exc.strerror or str(exc))
    with sock:
        sock.settimeout(5)
        try:
            sock.sendall(message)
            data = sock.recv(65536)
        except socket.timeout:
            return "no answer"
        except OSError as exc:
            return "closed: " + (exc.strerror or str(exc))
        return ("answered: " + data.decode(errors="replace")[:300]) if data else "closed"

def unix(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock

out = {f"tcp {p}": attempt(lambda p=p: socket.create_connection(("127.0.0.1", p), timeout=5)) for p in ports}
out.update({f"unix {p}": attempt(lambda p=p: unix(p)) for p in paths})
print(json.dumps(out))
"""


@pytest.fixture
def other_user() -> str:
    """The other Unix user's name, where this test can act as it (root, runuser, the user made)."""
    if os.getuid() != 0 or not shutil.which("runuser"):
        pytest.skip("acting as another Unix user needs root and runuser")
    try:
        pwd.getpwnam(OTHER)
    except KeyError:
        pytest.skip(f"no user {OTHER} here (tests/cluster/sshd-up.sh, or useradd -m {OTHER}, makes it)")
    return OTHER


def as_other(user: str, ports: list[int], paths: list[str]) -> dict[str, str]:
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    done = subprocess.run(["runuser", "-u", user, "--", python, "-c", PROBE, json.dumps(ports), json.dumps(paths)],
                          capture_output=True, text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def listening_ports(root: int) -> set[int]:
    """Every TCP port (IPv4 or IPv6, any address) a process of `root`'s tree listens on."""
    inodes = set()
    for pid in _descendants(root):
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes.update(link[len("socket:["):-1] for link in links if link.startswith("socket:["))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _debugger_event(run_dir: Path):
    return next((e for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "debugger"), None)


def _socket_ready(path: str) -> bool:
    return unix_listening(path)  # not the file alone: a killed attach of an earlier job with this id left one


def test_another_user_cannot_attach_to_a_local_debug_rank_and_the_owner_can(other_user, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    line = next(i for i, x in enumerate(SCRIPT.splitlines(), 1) if "# BREAK" in x)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "submit", "--executor", "local", "--debug-rank", "0",
                             "--run-dir", str(run_dir), str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    attach = None
    try:
        event = wait_until(lambda: _debugger_event(run_dir), 60, "the debugger event")
        assert event["owner_only"] and event["loopback"] and event["uid"] == os.getuid()
        attach = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "attach", str(run_dir)], cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        login_socket = debugrelay.login_socket_path(event["job_id"], 0)
        wait_until(lambda: _socket_ready(login_socket), 30, "hpc-ddp attach serving")
        ports = listening_ports(proc.pid) | listening_ports(attach.pid)
        assert event["port"] in ports  # the IDE's loopback port (the rank itself listens on none)

        seen = as_other(other_user, sorted(ports), [event["socket"], login_socket])
        assert not [k for k, v in seen.items() if v.startswith("answered")], seen
        assert seen[f"tcp {event['port']}"].startswith("closed"), seen  # taken, peer UID checked, closed unanswered
        assert seen[f"unix {event['socket']}"] == "refused: Permission denied", seen
        assert seen[f"unix {login_socket}"] == "refused: Permission denied", seen

        client = DapClient.unix(login_socket)  # the owner, through `hpc-ddp attach`: after the intruder
        try:
            stopped = client.attach_and_break(str(script), line)
            assert client.local_variable(stopped["body"]["threadId"], "secret") == "42"
            client.request("continue", threadId=stopped["body"]["threadId"])
            out, err = proc.communicate(timeout=60)
        finally:
            client.close()
        _, said = attach.communicate(timeout=30)  # it ends once the rank no longer waits
    finally:
        for child in (proc, attach):
            stop(child)
    assert proc.returncode == 0, out + err
    assert "[rank 0] secret=42" in out
    log = next(run_dir.glob("logs/job-local-*/attempt-0/rank-0.log")).read_text()
    uid = pwd.getpwnam(other_user).pw_uid
    assert f"debug relay: refused a connection from uid {uid}: only uid {os.getuid()} may reach" in log, log
    assert "a debugger attached" in said and "no longer waits for a debugger" in said, said
    assert not os.path.exists(event["socket"]) and not os.path.exists(login_socket)


def test_the_port_the_rank_connects_to_refuses_another_user_who_comes_first(other_user):
    """The one moment something listens for the rank: between the relay's start and the rank's connect.
    Another user who connects then is closed unanswered, and the rank still gets in after it."""
    path = debugrelay.node_socket_path(f"owner-only-{os.getpid()}", 0)
    ready = debugrelay.start(path, None, local=False)
    seen = as_other(other_user, [ready.rank_port], [])
    assert list(seen) == [f"tcp {ready.rank_port}"] and seen[f"tcp {ready.rank_port}"].startswith("closed"), seen
    with socket.create_connection(("127.0.0.1", ready.rank_port), timeout=10) as rank:
        ide = DapClient.unix(path, timeout=10)
        try:
            ide.sock.sendall(b"ping")
            rank.settimeout(10)
            assert rank.recv(4) == b"ping"
        finally:
            ide.close()
    wait_until(lambda: not os.path.exists(path), 10, "the relay ending with the rank")


@pytest.mark.slurm
def test_on_the_test_slurm_another_user_cannot_reach_the_rank_and_the_owner_attaches(slurm_conf, other_user,
                                                                                     tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    line = next(i for i, x in enumerate(SCRIPT.splitlines(), 1) if "# BREAK" in x)
    run_dir = tmp_path / "run"
    done = hpc_ddp("submit", "--executor", "sbatch", "--debug-rank", "0", "--run-dir", str(run_dir), "--json",
                   str(script), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = json.loads(done.stdout[done.stdout.index("{"):])["job_id"]
    attach = None
    try:
        event = wait_until(lambda: _debugger_event(run_dir), 120, "the debugger event")
        assert event["owner_only"] and not event["loopback"] and event["attach"] == f"hpc-ddp attach {job_id}"
        rank = _parent(_relay_pid(event["socket"]))  # the rank's process: the relay is its child
        ports = sorted(listening_ports(rank))  # at most the port the rank connects to, until it is in
        attach = subprocess.Popen([sys.executable, "-m", "hpc_ddp", "attach", job_id], cwd=tmp_path,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: _socket_ready(event["login_socket"]), 30, "hpc-ddp attach serving")
        seen = as_other(other_user, ports, [event["socket"], event["login_socket"]])
        assert not [k for k, v in seen.items() if v.startswith("answered")], seen
        assert seen[f"unix {event['socket']}"] == seen[f"unix {event['login_socket']}"] == \
            "refused: Permission denied", seen
        # once the rank is in, nothing of its listens on TCP at all
        wait_until(lambda: not listening_ports(rank), 30, "the relay to stop listening for the rank")
        step = subprocess.run(["runuser", "-u", other_user, "--", "srun", "--jobid", job_id, "--overlap", "-w",
                               event["node"], "-N1", "-n1", "true"], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "SLURM_CONF": slurm_conf}, cwd="/")
        # Slurm will not start a step in another user's job ("Access/permission denied"), though it runs theirs
        assert step.returncode != 0 and "permission denied" in step.stderr.lower(), step
        client = DapClient.unix(event["login_socket"])
        try:
            stopped = client.attach_and_break(str(script), line)
            assert client.local_variable(stopped["body"]["threadId"], "secret") == "42"
            client.request("continue", threadId=stopped["body"]["threadId"])
        finally:
            client.close()
        assert wait_for_job(job_id, timeout=120) == "COMPLETED"
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        stop(attach)
    assert not os.path.exists(event["login_socket"])  # attach, stopped as a user stops it, left nothing
    log = next(run_dir.glob(f"logs/job-{job_id}/attempt-0/rank-0.log")).read_text()
    assert "secret=42" in log and f"hpc-ddp: on the login node run: hpc-ddp attach {job_id}" in log


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _relay_pid(path: str) -> int:
    """The relay serving `path` on this machine (the test Slurm's nodes are this machine)."""
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hpc_ddp.job.debugrelay" in argv and path.encode() in argv and b"serve" in argv:
            return int(entry.name)
    raise AssertionError(f"no relay serves {path}")
