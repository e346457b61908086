"""A rank that hangs (alive but making no progress: SIGSTOPped, a frozen node, a deadlock) stops the attempt
within a limit derived from the step time observed, naming the rank and its node, instead of letting every
other rank wait in a collective until its timeout (10 minutes by default) or the allocation until its
time limit (issue 32).

Each rank runs one daemon thread. Once the attempt has completed ARM_AFTER steps, no step completing for
longer than `limit` = max(min_s, FACTOR x the observed step time) means a stall; phases where a step is not
expected (a checkpoint save, an evaluation: `Session.busy()`) pause the watch. On a stall the rank asks who
is gone (`rendezvous.explain_failure`: every rank's heartbeat thread beats while its main thread waits in
a collective, so a rank whose heartbeat stopped is the one that hangs), writes one line and a `stalled`
event, and leaves with STALL_EXIT_CODE; the executor then ends the other ranks (srun's --kill-on-bad-exit,
the local executor's stop).

`decide` is pure; the thread is the edge.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ARM_AFTER", "FACTOR", "MIN_S", "STALL_EXIT_CODE", "STORE_ANSWER_S", "limit_for", "stalled_for",
           "StallWatch"]

ARM_AFTER = 3            # steps this attempt must complete first: start-up, compilation and the first
FACTOR = 20.0            # steps' allocations are not steady-state step times
MIN_S = 300.0            # never sooner than this (HPC_DDP_STALL_MIN_S): a slow filesystem can hold one step
STALL_EXIT_CODE = 1      # a failed attempt: the crash-loop guard and the requeue policy judge it as one
FROZEN_TICKS = 5         # a tick this many intervals late: the watch's own process was stopped
STORE_ANSWER_S = 20.0    # how long to wait for the store to say who is gone (rank 0 holds it, and may hang)


def limit_for(step_seconds: float | None, min_s: float = MIN_S, cap_s: float | None = None) -> float | None:
    """How long without a completed step is a stall: FACTOR x the step time, at least `min_s`, at most
    `cap_s` (the collective timeout, which ends a hang anyway). None while there is no step time yet."""
    if step_seconds is None:
        return None
    limit = max(min_s, FACTOR * step_seconds)
    return min(limit, cap_s) if cap_s else limit


def stalled_for(now: float, last_step: float, steps_this_attempt: int, step_seconds: float | None,
                paused: bool, min_s: float = MIN_S, cap_s: float | None = None) -> float | None:
    """Seconds without a step, when that is a stall now; else None."""
    limit = limit_for(step_seconds, min_s, cap_s)
    if paused or limit is None or steps_this_attempt < ARM_AFTER:
        return None
    quiet = now - last_step
    return quiet if quiet > limit else None


class StallWatch:
    """The thread. `session` gives `step_seconds`, `last_step_at()` (time.monotonic of the last completed
    step), `steps_this_attempt()` and `paused()`; `on_stall(seconds, limit)` acts: it ends the process, or
    returns when the run went on meanwhile, and the watch goes on."""

    def __init__(self, session: Any, on_stall: Callable[[float, float], None], *, cap_s: float | None = None,
                 interval_s: float = 1.0):
        self.session, self.on_stall, self.cap_s, self.interval_s = session, on_stall, cap_s, interval_s
        self.min_s = float(os.environ.get("HPC_DDP_STALL_MIN_S") or MIN_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hpc-ddp-stall-watch", daemon=True)

    def start(self) -> "StallWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        s = self.session
        tick = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now, last = time.monotonic(), tick
            tick = now
            if now - last > FROZEN_TICKS * self.interval_s:
                continue  # this process itself was frozen (SIGSTOP, then SIGCONT): the hang was ours, not a peer's
            quiet = stalled_for(now, s.last_step_at(), s.steps_this_attempt(), s.step_seconds,
                                s.paused(), self.min_s, self.cap_s)
            if quiet is not None and not self._stop.is_set():
                # It ends the process, or returns when the run went on meanwhile (one long step): watch on.
                self.on_stall(quiet, limit_for(s.step_seconds, self.min_s, self.cap_s) or quiet)
