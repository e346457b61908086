"""Asynchronous checkpoints: a snapshot of the state in host memory, and one background writer.

`Snapshotter.take(payloads)` deep-copies what a checkpoint holds into host memory and returns at once
(on GPUs the copies are queued on the current CUDA stream into pinned buffers; the writer waits for
them, so even the device-to-host copy is off the loop). `BackgroundWriter` then runs the ordinary
crash-safe `CheckpointManager.save` on that copy in a thread: temp dir, fsync, manifest, rename,
`latest`, exactly as a blocking save, so a kill at any moment still leaves the old checkpoint or the
new one, never half of one.

What it promises:
- at most one write in flight: `start()` first waits for the previous one;
- a failed write is never silent: `check()` (and `wait()`/`start()`) raise its error on the caller's
  thread, once, as the same one-line CheckpointError a blocking save raises;
- `wait()` returns only when the write is durable (callers do it before exit 75 and at the end);
- the writer runs at the lowest CPU priority: it takes the cycles the loop leaves, and finishes at full
  speed once the loop waits for it (bench/README.md has what that costs and saves).

Why whole storages: a snapshot copies each tensor's whole storage once and rebuilds the same views on
the copy, because `torch.save` writes whole storages and keeps tensors that share one shared; so on the
CPU the files are byte for byte those of a blocking save (tested). On GPUs they differ only in the
device recorded (cpu, not cuda:N); loading maps everything to the CPU anyway.

Why the buffers are kept: writing into freshly allocated memory costs a page fault per page, about as
much as the copy itself; the next snapshot (which only starts once the previous write is done) reuses
the same buffers. The price is one extra copy of the checkpointed state in host memory on rank 0 for
the whole run.
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.common.errors import HpcDdpError
from hpc_ddp.trainer.checkpoint import CheckpointError

__all__ = ["Snapshot", "Snapshotter", "BackgroundWriter"]


class Snapshot:
    """Host-memory copies of some payloads; `ready()` blocks until queued device copies have landed."""

    def __init__(self, payloads: dict[str, Any], event: Any = None, buffers: list[torch.UntypedStorage] = ()):
        self.payloads, self._event, self.buffers = payloads, event, list(buffers)

    def ready(self) -> dict[str, Any]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.payloads


class Snapshotter:
    """Takes snapshots, reusing the host buffers of the previous one (see the module docstring)."""

    def __init__(self) -> None:
        self._pool: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}

    def take(self, payloads: Mapping[str, Any]) -> Snapshot:
        """A deep copy of `payloads` whose tensors live in host memory. Call `recycle()` with the previous
        snapshot once nothing reads it any more, so its buffers serve the next one."""
        copies: dict[int, torch.Tensor] = {}    # id(tensor) -> its copy: deepcopy's memo
        storages: dict[int, torch.UntypedStorage] = {}  # storage -> its host copy
        used: list[torch.UntypedStorage] = []
        on_gpu = False
        for tensor in _tensors(payloads):
            if id(tensor) in copies:
                continue
            if not _plain_dense(tensor):
                copies[id(tensor)] = _fallback_copy(tensor)
                continue
            source = tensor.untyped_storage()
            key = source._cdata  # the StorageImpl: how torch.save itself tells shared storages apart
            if key not in storages:
                on_gpu |= source.device.type == "cuda"
                storages[key] = self._buffer(source.nbytes(), pinned=source.device.type == "cuda")
                storages[key].copy_(source, non_blocking=source.device.type == "cuda")
                used.append(storages[key])
            view = torch.empty(0, dtype=tensor.dtype)
            view.set_(storages[key], tensor.storage_offset(), tensor.size(), tensor.stride())
            copies[id(tensor)] = view.requires_grad_(tensor.requires_grad) if tensor.is_leaf else view
        event = None
        if on_gpu:  # the loop goes on at once; the writer waits for this before reading the copies
            event = torch.cuda.Event()
            event.record()
        memo: dict[int, Any] = dict(copies)
        return Snapshot(copy.deepcopy(dict(payloads), memo), event, used)

    def recycle(self, snapshot: Snapshot) -> None:
        for buffer in snapshot.buffers:
            self._pool.setdefault((buffer.nbytes(), buffer.is_pinned()), []).append(buffer)
        snapshot.buffers.clear()

    def _buffer(self, nbytes: int, pinned: bool) -> torch.UntypedStorage:
        free = self._pool.get((nbytes, pinned))
        if free:
            return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()


def _tensors(value: Any):
    """Every tensor in a payload: checkpoints hold tensors in mappings, lists and tuples (session.py
    refuses anything else before a snapshot is taken)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _plain_dense(tensor: torch.Tensor) -> bool:
    return (type(tensor) is torch.Tensor and tensor.layout == torch.strided and not tensor.is_quantized
            and tensor.device.type in ("cpu", "cuda"))


def _fallback_copy(tensor: torch.Tensor) -> torch.Tensor:
    """Sparse, quantized, subclassed or other unusual tensors: an ordinary (blocking) copy."""
    if tensor.device.type == "cpu":
        return copy.deepcopy(tensor)
    return tensor.detach().to("cpu", copy=True)


def _lowest_cpu_priority() -> None:
    """Nice this thread (and the hashing thread it starts, which inherits it) to 19: on a node whose cores
    the training loop keeps busy, the write takes the cycles the loop leaves, not the loop's. Linux
    applies a nice value given a thread id to that thread only; elsewhere this is a no-op."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed: write at normal priority
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class BackgroundWriter:
    """Runs one checkpoint write at a time in a thread and hands its outcome back to the caller's thread."""

    def __init__(self, log: Callable[[str], None] = print):
        self.log = log
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path: Path | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, write: Callable[[], Path], done: Callable[[Path, float], None] | None = None) -> None:
        """Run `write()` (a crash-safe save returning its path) in the background; first wait for the
        one in flight, raising its error if it failed. `done(path, seconds)` runs on the writer thread
        once the checkpoint is durable."""
        self.wait()
        self._path = None

        def run() -> None:
            _lowest_cpu_priority()
            started = time.monotonic()
            try:
                path = write()
                self._path = path
                if done is not None:
                    done(path, time.monotonic() - started)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread by check()
                self._error = exc

        self._thread = threading.Thread(target=run, name="hpc-ddp-checkpoint-writer", daemon=False)
        self._thread.start()

    def wait(self) -> Path | None:
        """Block until the write in flight (if any) is durable; its path, or raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()
        return self._path

    def check(self) -> None:
        """Raise (once) the error of a finished background write; never blocks."""
        if self.busy or self._error is None:
            return
        exc, self._error = self._error, None
        if isinstance(exc, HpcDdpError):
            raise exc.with_traceback(None)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"the background checkpoint write failed: {type(exc).__name__}: {first}") from exc
