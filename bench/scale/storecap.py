"""How many requests one TCPStore server answers per second on this machine: the yardstick for the
store columns of `make scale` (bench/README.md, "Scale", the arithmetic for 1,024 nodes).

    python -m bench.scale.storecap            # 1, 4 and 16 client processes, 3 s each

The server runs in this process, as it runs in rank 0's; clients are separate processes (no shared GIL),
each sending `check` of one key back to back, which is what a waiting rank's poll is. On a 2-core
machine the clients and the server share the cores, so this is a lower bound of what a server with a
core of its own answers. Not part of `make scale`: its numbers are the machine's, not the code's.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist

__all__ = ["measure"]


def _client(port: int, seconds: float, start, out) -> None:
    store = dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=30))
    start.wait()
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        store.check(["k"])
        n += 1
    out.put(n)


def measure(clients: int, seconds: float = 3.0) -> float:
    """Requests per second the server answered, `clients` processes asking at once."""
    from hpc_ddp.job.ports import first_free_port

    port = first_free_port(26000 + os.getpid() % 2000)
    server = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=30), wait_for_workers=False)
    server.set("k", "1")
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client, args=(port, seconds, start, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    time.sleep(1.0)  # every client connected
    start.set()
    total = sum(out.get(timeout=seconds + 30) for _ in procs)
    for p in procs:
        p.join(10)
    return total / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    print(json.dumps({n: round(measure(int(n), args.seconds)) for n in args.clients.split(",")}))


if __name__ == "__main__":
    main()
