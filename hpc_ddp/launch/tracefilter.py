"""What of a rank's output reaches the terminal of a run in the foreground (the local executor): every line,
except a library's stack trace that follows hpc-ddp's own one-line message about a stop.

At a clean stop, torch's c10d may print, on a rank that has no line of its own, after rank 0's "hpc-ddp:
stop requested ...; checkpointing", a C++ trace of 45 lines ("[W... TCPStore.cpp:...] recvValue failed ...
Connection reset by peer", "Exception raised from ...", "frame #0:" to "frame #27:"): the store's peer ended
first, which is how a stop ends. hpc-ddp has already said what happened in one line, so the trace stays in
the rank's log (the log gets every line) and the terminal gets one line saying where it is. The ranks of an
attempt share one `Stop` (any rank's stop line counts). A trace before any stop line is the failure itself
and is shown whole, as is a Python traceback, which is the program's.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

__all__ = ["TerminalFilter", "Stop"]

# hpc-ddp's own lines about a stop (the Session's, the built-in trainer's), and its one-line errors: after
# "rank 1 (host) failed: ...; stopping", the other ranks' c10d traces of the closed store say nothing more
# (issue 43: a Session error on one rank printed the others' frame dumps).
_STOP = re.compile(r"^hpc-ddp: (?:.*(?:stop requested|checkpointing at|checkpointed|training finished|stopped by SIG)"
                   r"|error: )")
# c10's log lines ("[W1127 16:00:00.123456 4242 torch/csrc/distributed/c10d/TCPStore.cpp:122] ..."), a C++
# exception's frames, and the lines torch puts between them.
_TRACE = re.compile(r"^(?:(?:\[rank\d+\]:)?\[[WEF]\d{4} \d\d:\d\d:\d\d[.\d]*(?: +\d+)? [^\]]*\] "
                    r"|Exception raised from |frame #\d+: "
                    r"|terminate called after throwing|  what\(\): )")


class Stop:
    """Whether any rank of the attempt has said, in hpc-ddp's own line, that it stops."""

    def __init__(self):
        self.said = False


class TerminalFilter:
    """Feed each line of one rank's output; what comes back goes to the terminal."""

    def __init__(self, log_path: str, stop: Stop | None = None):
        self.log_path = log_path
        self.stop = stop or Stop()  # shared by the attempt's ranks
        self.held = 0               # lines of the trace under way kept out of the terminal

    def feed(self, line: str) -> Iterator[str]:
        if self.stop.said and (_TRACE.match(line) or (self.held and not line.strip())):
            self.held += 1
            return
        yield from self.close()
        if _STOP.match(line):
            self.stop.said = True
        yield line

    def close(self) -> Iterator[str]:
        """The note for a trace just left out (at its end, or at the end of the output)."""
        if self.held:
            yield (f"hpc-ddp: {self.held} line{'s' if self.held != 1 else ''} of a library's trace after the stop, "
                   f"left out here: {self.log_path}\n")
            self.held = 0
