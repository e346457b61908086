"""Text that is safe where it lands in a bash script: one word (`bash_word`), a list of words on one line
(`bash_line`), and free text after `# ` (`comment_text`). Each keeps a value on its line, whatever it holds
(newlines, control characters, quotes): what a terminal shows is what bash runs. Pure.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable

__all__ = ["bash_word", "bash_line", "comment_text"]


def bash_line(words: Iterable[str]) -> str:
    """Words as one line of a bash script: `bash_word` each, joined by spaces."""
    return " ".join(bash_word(str(w)) for w in words)


def bash_word(value: str) -> str:
    """`value` as one bash word: shlex.quote where every character is printable, else $'...' with each
    other character escaped (newline, CR, ESC, bidi controls, ...), so the text holds no raw control
    character: no value can end a line, and what the terminal shows is what bash runs."""
    if value.isprintable():
        return shlex.quote(value)
    return "$'" + "".join(_ansi_c(c) for c in value) + "'"


_ANSI_C = {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _ansi_c(c: str) -> str:
    if c in _ANSI_C:
        return _ANSI_C[c]
    if c.isprintable():
        return c
    try:  # the bytes the value stands for (surrogateescape: bytes that were not UTF-8 in argv)
        raw = c.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raw = c.encode("utf-8", "surrogatepass")
    return "".join(f"\\x{b:02x}" for b in raw)


def comment_text(text: str) -> str:
    """Free text safe after `# `: every character that is not printable is shown escaped (\\n, \\x1b,
    \\u202e), never as itself, so it can neither end the comment line nor disguise it on a terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)
