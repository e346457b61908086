"""How long the simulated ranks asked to sleep: `time.sleep` wrapped for threads named `rank-*`.

Polling loops sleep between polls; on a machine with fewer cores than ranks they also wait for the CPU,
so they poll less often than the code asks. Ops counted over the seconds the ranks *asked* to sleep give
the rate the code would make with a core per rank (see sim_stage)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator

__all__ = ["Slept", "real_sleep", "recording"]

real_sleep = time.sleep


class Slept:
    def __init__(self):
        self.seconds: Counter[str] = Counter()   # thread name -> seconds asked for
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, who: str, seconds: float) -> None:
        with self._lock:
            self.seconds[who] += seconds
            self.calls[who] += 1

    def snapshot(self) -> Counter:
        with self._lock:
            return Counter(self.seconds)


@contextlib.contextmanager
def recording() -> Iterator[Slept]:
    slept = Slept()

    def sleep(seconds: float) -> None:
        name = threading.current_thread().name
        if name.startswith("rank-"):
            slept.add(name, seconds)
        real_sleep(seconds)

    time.sleep = sleep
    try:
        yield slept
    finally:
        time.sleep = real_sleep
