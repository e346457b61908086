"""The debug rank's relay (job.debugrelay): who it lets in (peer UID), where its sockets live and with which
modes, and that it joins the rank and an IDE both ways. Another Unix user is refused for real in
tests/e2e/test_debug_owner_only.py."""

from __future__ import annotations

import base64
import os
import socket
import stat
import subprocess
import sys
import time
import uuid

import pytest

from hpc_ddp.common.errors import EnvError
from hpc_ddp.job import debugrelay


def test_proc_net_tcp_addresses_are_written_as_the_kernel_does():
    expected = "0100007F:162E" if sys.byteorder == "little" else "7F000001:162E"
    assert debugrelay._proc_net_address(("127.0.0.1", 5678)) == expected


def test_the_peer_uid_of_a_loopback_connection_comes_from_proc_net_tcp(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, _ = server.accept()
        with client, conn:
            assert debugrelay.peer_uid(conn) == os.getuid()
            theirs = debugrelay._proc_net_address(conn.getpeername())
            ours = debugrelay._proc_net_address(conn.getsockname())
            table = tmp_path / "tcp"
            table.write_text("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
                             f"   0: {ours} {theirs} 01 00000000:00000000 00:00000000 00000000  0 0 1 1\n"
                             f"   1: {theirs} {ours} 01 00000000:00000000 00:00000000 00000000  1001 0 2 1\n")
            assert debugrelay.peer_uid(conn, str(table)) == 1001  # the peer's own line, not ours
            table.write_text("header\n")
            assert debugrelay.peer_uid(conn, str(table)) is None  # gone: cannot be told, refused


def test_the_peer_uid_of_a_unix_connection_is_its_credentials():
    left, right = socket.socketpair()
    with left, right:
        assert debugrelay.peer_uid(left) == os.getuid()


def test_a_foreign_peer_is_closed_unanswered(monkeypatch):
    monkeypatch.setattr(debugrelay, "peer_uid", lambda conn: os.getuid() + 1)
    said: list[str] = []
    left, right = socket.socketpair()
    with right:
        assert not debugrelay.owner_only(left, said.append)
        assert left.fileno() == -1 and right.recv(10) == b""  # closed, nothing sent
    assert said == [f"refused a connection from uid {os.getuid() + 1}: only uid {os.getuid()} may reach this "
                    "debugger"]


def test_the_private_dir_is_made_0700_and_anything_else_there_is_refused(tmp_path):
    made = debugrelay.private_dir(str(tmp_path))
    assert made == tmp_path / f"hpc-ddp-{os.getuid()}" and stat.S_IMODE(made.stat().st_mode) == 0o700
    made.chmod(0o755)
    with pytest.raises(EnvError, match="is not a private directory of yours"):
        debugrelay.private_dir(str(tmp_path))
    made.rmdir()
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    made.symlink_to(tmp_path / "elsewhere")  # a planted link to a dir of ours is refused too
    with pytest.raises(EnvError, match="is not a private directory of yours"):
        debugrelay.private_dir(str(tmp_path))


def test_a_unix_socket_is_0600_and_a_stale_one_is_replaced_but_a_live_one_refused(tmp_path):
    path = str(debugrelay.private_dir(str(tmp_path)) / "r.sock")
    first = debugrelay.listen_unix(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_ISSOCK(os.stat(path).st_mode)
    with pytest.raises(EnvError, match="in use: another relay"):
        debugrelay.listen_unix(path)
    first.close()  # killed relays leave their socket file behind
    debugrelay.listen_unix(path).close()
    os.unlink(path)
    open(path, "w").close()
    with pytest.raises(EnvError, match="exists and is not a socket"):
        debugrelay.listen_unix(path)
    with pytest.raises(EnvError, match="a debug socket must be in"):
        debugrelay.listen_unix(str(tmp_path / "r.sock"))


def test_a_taken_debug_port_is_refused_and_the_default_is_the_first_free_from_5678():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(EnvError, match=f"--debug-port {port} is already in use"):
            debugrelay.listen_tcp(port)
    with debugrelay.listen_tcp(None) as free:
        assert debugrelay.FIRST_PORT <= free.getsockname()[1] < debugrelay.FIRST_PORT + 50


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def test_the_relay_joins_the_rank_and_one_ide_and_ends_with_the_rank():
    path = debugrelay.node_socket_path(f"test-{uuid.uuid4().hex[:8]}", 0)
    ready = debugrelay.start(path, None, local=True)  # as the runner does, just before it becomes the rank
    assert ready.socket == path and ready.ide_port is not None
    rank = socket.create_connection(("127.0.0.1", ready.rank_port), timeout=10)
    rank.sendall(b"sent before any IDE came")
    ide = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ide.settimeout(10)
    ide.connect(path)
    assert _recv_exactly(ide, 24) == b"sent before any IDE came"
    ide.sendall(b"initialize")
    assert _recv_exactly(rank, 10) == b"initialize"
    with socket.create_connection(("127.0.0.1", ready.ide_port), timeout=10) as second:
        assert second.recv(10) == b""  # one IDE at a time: the second is closed
    ide.close()  # the IDE leaves; another may come, over the loopback port this time
    time.sleep(0.2)
    with socket.create_connection(("127.0.0.1", ready.ide_port), timeout=10) as again:
        time.sleep(0.2)
        rank.sendall(b"stopped")
        assert _recv_exactly(again, 7) == b"stopped"
        rank.close()  # the rank ended: so does the relay, and its socket goes
        assert again.recv(10) == b""
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not os.path.exists(path)


def test_the_bridge_passes_stdin_on_and_the_relays_bytes_back_as_base64_lines(tmp_path):
    path = str(debugrelay.private_dir(str(tmp_path)) / "b.sock")
    with debugrelay.listen_unix(path) as listener:
        proc = subprocess.Popen([sys.executable, "-m", "hpc_ddp.job.debugrelay", "bridge", path],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        conn, _ = listener.accept()
        with conn:
            proc.stdin.write(b"Content-Length: 2\r\n\r\n{}")
            proc.stdin.flush()
            assert _recv_exactly(conn, 23) == b"Content-Length: 2\r\n\r\n{}"
            conn.sendall(b"\x00no newline\r\n\xff")
            line = proc.stdout.readline()
            assert debugrelay.decode_line(line) == b"\x00no newline\r\n\xff" and line.endswith(b"\n")
            proc.stdin.close()  # the IDE left: the bridge ends its side
            assert conn.recv(10) == b""
        assert proc.wait(10) == 0
    assert debugrelay.decode_line(b"srun: warning: something\n") == b""
    assert debugrelay.decode_line(base64.b64encode(b"x") + b"\n") == b"x"
