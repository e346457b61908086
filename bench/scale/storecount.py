"""Counting TCPStore requests: every store the code under test creates is wrapped.

`counting()` replaces `torch.distributed.TCPStore` (what `hpc_ddp.trainer.rendezvous` calls) by a
factory that builds the real store and wraps it in `CountingStore`, a `dist.Store` written in Python:
the code's `PrefixStore`s wrap it as they would the real one, and each method call is one request to
the server (one round trip), counted by method and by calling thread. Creating a client counts as one
`connect` (TCPStore's handshake); a raw socket probe of the server's port (`socket.create_connection`,
the rendezvous' wait for rank 0) counts as one `probe`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

__all__ = ["CountingStore", "Requests", "counting"]


class Requests:
    def __init__(self):
        self.by_kind: Counter[str] = Counter()
        self.by_thread: Counter[str] = Counter()
        self.first_at: dict[tuple[str, str], float] = {}  # (thread, kind) -> when that thread first made one
        # A store written in Python lives only as long as its Python object: a PrefixStore over it holds the
        # C++ side alone, and calls into a collected one fail ("Not implemented"). Keep every one alive.
        self.stores: list[CountingStore] = []
        self._lock = threading.Lock()

    def add(self, kind: str) -> None:
        who = threading.current_thread().name
        with self._lock:
            self.by_kind[kind] += 1
            self.by_thread[who] += 1
            self.first_at.setdefault((who, kind), time.monotonic())

    def total(self) -> int:
        with self._lock:
            return sum(self.by_kind.values())

    def snapshot(self) -> tuple[Counter, Counter]:
        with self._lock:
            return Counter(self.by_kind), Counter(self.by_thread)


class CountingStore(dist.Store):
    """The real store's methods, each counted once."""

    def __init__(self, inner: dist.Store, requests: Requests):
        super().__init__()
        self.inner, self.requests = inner, requests

    def _count(self, kind: str) -> None:
        self.requests.add(kind)

    def set(self, key, value):
        self._count("set")
        return self.inner.set(key, value)

    def get(self, key):
        self._count("get")
        return self.inner.get(key)

    def add(self, key, value):
        self._count("add")
        return self.inner.add(key, value)

    def check(self, keys):
        self._count("check")
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        self._count("wait")
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key):
        self._count("delete_key")
        return self.inner.delete_key(key)

    def compare_set(self, key, expected, desired):
        self._count("compare_set")
        return self.inner.compare_set(key, expected, desired)

    def multi_get(self, keys):
        self._count("multi_get")
        return self.inner.multi_get(keys)

    def multi_set(self, keys, values):
        self._count("multi_set")
        return self.inner.multi_set(keys, values)

    def append(self, key, value):
        self._count("append")
        return self.inner.append(key, value)

    def num_keys(self):
        self._count("num_keys")
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta):
        return self.inner.set_timeout(timeout)


@contextlib.contextmanager
def counting() -> Iterator[Requests]:
    requests = Requests()
    real_store, real_connect = dist.TCPStore, socket.create_connection

    def tcpstore(*args, **kwargs):
        store = CountingStore(real_store(*args, **kwargs), requests)
        requests.add("connect")
        requests.stores.append(store)
        return store

    def probe(*args, **kwargs):
        requests.add("probe")
        return real_connect(*args, **kwargs)

    dist.TCPStore, socket.create_connection = tcpstore, probe
    try:
        yield requests
    finally:
        dist.TCPStore, socket.create_connection = real_store, real_connect
