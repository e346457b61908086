"""A minimal Debug Adapter Protocol client (what VS Code and PyCharm speak to debugpy), for the tests:
attach, set a breakpoint, wait for the stop, read a variable, continue."""

from __future__ import annotations

import json
import socket
import time
from typing import Any


class DapClient:
    def __init__(self, host: str, port: int, timeout: float = 60, *, sock: socket.socket | None = None):
        self.sock = sock if sock is not None else socket.create_connection((host, port), timeout=timeout)
        self.buf = b""
        self.seq = 0
        self.pending: list[dict[str, Any]] = []  # messages read while waiting for another

    @classmethod
    def unix(cls, path: str, timeout: float = 60) -> "DapClient":
        """A client through a Unix socket (`hpc-ddp attach`'s, or the relay's on the node)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            raise
        return cls("", 0, sock=sock)

    def close(self) -> None:
        self.sock.close()

    def send(self, command: str, **arguments: Any) -> int:
        self.seq += 1
        body = json.dumps({"seq": self.seq, "type": "request", "command": command, "arguments": arguments}).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self.seq

    def _read(self) -> dict[str, Any]:
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(self.buf) < length:
            self._fill()
        body, self.buf = self.buf[:length], self.buf[length:]
        return json.loads(body)

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ConnectionError("debugpy closed the connection")
        self.buf += chunk

    def wait(self, match, timeout: float = 60) -> dict[str, Any]:
        """The first message (already read or to come) for which match(msg) is true."""
        deadline = time.monotonic() + timeout
        while True:
            for msg in self.pending:
                if match(msg):
                    self.pending.remove(msg)
                    return msg
            if time.monotonic() > deadline:
                raise TimeoutError(f"no matching DAP message within {timeout} s; saw {self.pending[-5:]}")
            self.pending.append(self._read())

    def response(self, seq: int, timeout: float = 60) -> dict[str, Any]:
        msg = self.wait(lambda m: m.get("type") == "response" and m.get("request_seq") == seq, timeout)
        assert msg["success"], msg
        return msg

    def event(self, name: str, timeout: float = 60) -> dict[str, Any]:
        return self.wait(lambda m: m.get("type") == "event" and m.get("event") == name, timeout)

    def request(self, command: str, **arguments: Any) -> dict[str, Any]:
        return self.response(self.send(command, **arguments))

    def attach_and_break(self, path: str, line: int) -> dict[str, Any]:
        """Attach, break at path:line, let the program run: the `stopped` event."""
        self.request("initialize", adapterID="debugpy", clientID="hpc-ddp-test", linesStartAt1=True,
                     columnsStartAt1=True, pathFormat="path")
        attach = self.send("attach", justMyCode=False)
        self.event("initialized")
        found = self.request("setBreakpoints", source={"path": path}, breakpoints=[{"line": line}])
        assert found["body"]["breakpoints"][0]["verified"], found
        self.request("configurationDone")
        self.response(attach)
        return self.event("stopped")

    def local_variable(self, thread_id: int, name: str) -> str:
        frame = self.request("stackTrace", threadId=thread_id)["body"]["stackFrames"][0]
        scopes = self.request("scopes", frameId=frame["id"])["body"]["scopes"]
        for scope in scopes:
            for var in self.request("variables", variablesReference=scope["variablesReference"])["body"]["variables"]:
                if var["name"] == name:
                    return var["value"]
        raise KeyError(name)
