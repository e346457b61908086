"""Is a TCP port free on this host, and what to tell the user when the rendezvous port is not.
No torch here: the runner checks the port before it execs anything."""

from __future__ import annotations

import errno
import socket

__all__ = ["port_in_use", "first_free_port", "taken_port_message", "PORT_HINT"]

PORT_HINT = ("choose another: hpc-ddp submit --master-port N (or master_port = N in the job file); "
             "by default the port is derived from the job id")


def port_in_use(port: int, host: str = "") -> bool:
    """Would a server fail to listen on `port`? Binds with SO_REUSEADDR, as TCPStore does, so a port
    left in TIME_WAIT by the previous attempt does not count as taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def first_free_port(start: int, tries: int = 50) -> int:
    return next((p for p in range(start, start + tries) if not port_in_use(p)), start)


def taken_port_message(port: int, host: str) -> str:
    return (f"MASTER_PORT {port} is already in use on {host} (by another job or process), so rank 0 "
            "cannot host the rendezvous")
