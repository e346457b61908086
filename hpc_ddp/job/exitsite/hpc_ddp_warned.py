"""In a rank's Python: record in the run's events that the time-limit warning reached a handler of the
program's own, so that an exit 0 after it is known to be a stop, not a completion.

The runner sets the warning signal (HPC_DDP_WARNING_SIGNAL, SIGUSR2 unless --signal) to "ignore" before it
execs the program: a program without a handler runs on, and its exit 0 is a completion. A program that
installs a handler (a script's own, Lightning's for SIGUSR1) may save and leave with exit 0 when the warning
comes. `install()` wraps `signal.signal` so that such a handler, when the warning calls it, first appends
{"event": "warned", ...} to the run's events file ($HPC_DDP_EVENTS_FILE; once per process; O_APPEND,
never through a link); the requeue policy then counts that attempt as stopped by the time limit (job/attempts.py).
`signal.getsignal` still returns the program's own handler. Imports nothing from hpc-ddp.
"""

import contextlib
import json
import os
import signal
import time

SIGNAL_VARIABLE = "HPC_DDP_WARNING_SIGNAL"
EVENTS_VARIABLE = "HPC_DDP_EVENTS_FILE"  # the run dir's events file, as the runner names it


def install(environ=os.environ):
    """Wrap signal.signal in this process (idempotent; a no-op outside an hpc-ddp rank)."""
    name, events = environ.get(SIGNAL_VARIABLE), environ.get(EVENTS_VARIABLE)
    signum = getattr(signal, f"SIG{name}", None) if name else None
    if signum is None or not events or getattr(signal.signal, "_hpc_ddp_warned", False):
        return
    original_signal, original_getsignal = signal.signal, signal.getsignal
    theirs = {}
    noted = []

    def note(_signum, _frame):
        if noted:
            return
        noted.append(True)
        record = {"time": round(time.time(), 3), "event": "warned", "signal": name,
                  "rank": environ.get("RANK"), "job_id": environ.get("HPC_DDP_JOB_ID")}
        with contextlib.suppress(OSError):  # no run dir here (a copied environment): the handler still runs
            fd = os.open(events, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.write(fd, (json.dumps(record) + "\n").encode())
            finally:
                os.close(fd)

    def wrapped_signal(sig, handler):
        if sig != signum or not callable(handler):
            theirs.pop(sig, None)
            return original_signal(sig, handler)

        def on_warning(s, frame):
            note(s, frame)
            return handler(s, frame)
        previous = original_signal(sig, on_warning)
        old = theirs.get(sig, previous)
        theirs[sig] = handler
        return old

    def wrapped_getsignal(sig):
        return theirs.get(sig, original_getsignal(sig)) if sig == signum else original_getsignal(sig)

    wrapped_signal._hpc_ddp_warned = True
    wrapped_signal.__doc__, wrapped_getsignal.__doc__ = original_signal.__doc__, original_getsignal.__doc__
    signal.signal, signal.getsignal = wrapped_signal, wrapped_getsignal
