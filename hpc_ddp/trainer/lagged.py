"""The step's agreed flags [loss sum, stop, checkpoint due], read one step late on GPUs.

Reading a GPU tensor on the host waits for every kernel queued before it. `Session.step()` needs the
flags all ranks agreed on, so reading them at once would make each step wait for its own backward and
optimizer step before the next one could be queued: the GPU idles while Python fetches the next batch
and launches its first kernels. Instead each step queues a copy of its flags into pinned host memory
and records an event, then reads the previous step's copy: waiting for that event waits only until the
GPU finishes the previous step, while this step's kernels are already queued behind it. The host stays
at most one step ahead, and nothing is lost: the step that reads a stop request is the one the ranks stop
at, and every step's loss is still recorded (one step later, under its own step number). Session reads
the pending flags at once before any save, in settle() and when the run ends. On the CPU the flags are
read at once (no queue to overlap).
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["LaggedFlags"]


class LaggedFlags:
    """Hands back, for each pushed (flags, info), the flags and info of the push before it."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []   # two host buffers, used in turn
        self._turn = 0
        self._pending: tuple[Any, torch.Tensor, Any] | None = None

    def push(self, flags: torch.Tensor, info: Any) -> tuple[Any, list[float]] | None:
        """Queue a copy of `flags` (tagged with `info`); return the previous push's (info, values), if any.
        The buffer written now is not the one the previous push used, which is read below."""
        host = self._buffer(flags)
        on_gpu = flags.device.type == "cuda"
        host.copy_(flags.detach(), non_blocking=on_gpu)
        event = None
        if on_gpu:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flags.device))  # the stream the copy was queued on
        previous, self._pending = self._pending, (info, host, event)
        return _read(previous)

    def drain(self, timeout: float | None = None) -> tuple[Any, list[float]] | None:
        """The last push's (info, values), None when nothing is pending. With a timeout, a copy that has
        not landed by then is dropped and TimeoutError raised (a stream stuck behind a failed collective
        must not hold the process)."""
        previous, self._pending = self._pending, None
        if previous is not None and timeout is not None and previous[2] is not None:
            deadline = time.monotonic() + timeout
            while not previous[2].query():
                if time.monotonic() >= deadline:
                    raise TimeoutError("the step's flags did not arrive")
                time.sleep(0.001)
        return _read(previous)

    def discard(self) -> None:
        """Forget the pending push."""
        self._pending = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def _buffer(self, flags: torch.Tensor) -> torch.Tensor:
        pinned = flags.device.type == "cuda"
        if not self._buffers or (self._buffers[0].shape, self._buffers[0].dtype, self._buffers[0].is_pinned()) != (
                flags.shape, flags.dtype, pinned):
            self._buffers = [torch.empty(flags.shape, dtype=flags.dtype, pin_memory=pinned) for _ in range(2)]
        self._turn ^= 1
        return self._buffers[self._turn]


def _read(entry: tuple[Any, torch.Tensor, Any] | None) -> tuple[Any, list[float]] | None:
    if entry is None:
        return None
    info, host, event = entry
    if event is not None:
        event.synchronize()  # the step before the one just queued: done, or nearly
    return info, host.tolist()
