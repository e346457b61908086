"""What hpc-ddp prints for people is shown, never obeyed: control characters that came from files or names
(a sweep value, a job name, a run dir, a reason in events.jsonl) could otherwise move the cursor, clear the
screen, retitle the terminal or reorder text (Unicode bidi controls). `printable` writes each one as a
visible escape; tabs and newlines stay. JSON output needs none of this: json.dumps escapes them itself.
A rank's own output (`hpc-ddp logs`) is the user's program speaking, and is passed on as it is."""

from __future__ import annotations

import re

__all__ = ["printable"]

# C0 controls but tab and newline; DEL and C1 (a lone 0x9b is CSI on some terminals); the bidi embeddings,
# overrides and isolates (text shown in another order than it is stored), and the marks that steer them
# (LRM, RLM, ALM); the line and paragraph separators (a terminal may break the line there).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with every control character shown as an escape (\\x1b, \\u202e), tabs and newlines kept."""
    return _CONTROL.sub(_escape, text)
