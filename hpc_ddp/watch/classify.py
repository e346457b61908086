"""Why did a run fail? Pure: text of the logs -> (kind, detail). The first matching rule wins, so the
most specific causes come first."""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["classify_failure", "KINDS"]

_RULES = [
    ("out_of_memory", re.compile(r"CUDA out of memory|OutOfMemoryError|oom[-_ ]kill|Out Of Memory|MemoryError")),
    ("node_failure", re.compile(r"DUE TO NODE FAILURE|NODE_FAIL|Node failure on")),
    ("time_limit", re.compile(r"DUE TO TIME LIMIT")),
    ("preempted", re.compile(r"DUE TO PREEMPTION")),
    # the stall watch's own error line (trainer/sessionstep.py): a rank that hangs mid-training, rank 0
    # included, whose line names the rendezvous store it holds. Its warning for one long step that then went
    # on ("..., then the run went on: not a stall") is no failure: a starved rank prints it under load.
    ("stalled", re.compile(r"error: rank \d+: no step completed for \d+ s \(the limit is")),
    ("rank_lost", re.compile(r"stopped responding \(no heartbeat|rendezvous store at \S+ stopped answering")),
    ("rendezvous_timeout", re.compile(r"DistNetworkError|TCPStore|Timed out waiting|timed out after .*rendezvous|"
                                      r"Connection refused.*MASTER|rendezvous", re.IGNORECASE)),
    ("user_code_exception", re.compile(r"Traceback \(most recent call last\)")),
]
KINDS = tuple(kind for kind, _ in _RULES)
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")


def classify_failure(texts: Iterable[str]) -> tuple[str, str] | None:
    """(kind, the line that shows it) for the first rule that matches any text; None if nothing does."""
    texts = list(texts)
    for kind, pattern in _RULES:
        found = [(text, match) for text in texts for match in [pattern.search(text)] if match]
        if kind == "user_code_exception":
            # a rank killed while it printed its traceback (srun's --kill-on-bad-exit, after another rank's
            # crash) leaves one without its exception line: the complete one says what happened
            found.sort(key=lambda tm: _exception_line(tm[0], tm[1]) is None)
        if found:
            return kind, _detail(kind, *found[0])
    return None


def _exception_line(text: str, match: re.Match) -> str | None:
    """The exception line of the traceback at `match`: the first non-indented line after its frames.
    torch's elastic error handler prefixes every line of a rank's traceback with "[rankN]: "."""
    tail = [_RANK_PREFIX.sub("", line) for line in text[match.start():].splitlines()]
    for line in tail[1:]:
        if line and not line.startswith((" ", "\t", "Traceback")):
            return line.strip()[:300]
    return None


def _detail(kind: str, text: str, match: re.Match) -> str:
    if kind == "user_code_exception":
        line = _exception_line(text, match)
        if line is not None:
            return line
    line_start = text.rfind("\n", 0, match.start()) + 1
    line_end = text.find("\n", match.end())
    return text[line_start:line_end if line_end != -1 else None].strip()[:300]
