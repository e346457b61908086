"""The compile check with the ranks' own Python, where that is another interpreter than this one.

`scriptcheck.compile_findings` compiles the script with the Python hpc-ddp runs in. The ranks may run
another (`--python`, or the env that was active at submit): a script with a `match` statement compiles here
on 3.12 and fails on every rank of a 3.9 env; one with 3.14's t-strings fails here on 3.11 and is fine there.
So, before anything queues, that Python is asked for its own verdict on the bytes this check read:
`-I -c CODE NAME` with them on its stdin runs nothing of the user's (they are compiled, not executed; `-I`
keeps every PYTHON* variable, the user's site and the current folder out), in a bounded time. Where it
cannot be asked (not runnable here, looked up after the job's setup lines, in a container, no answer in
time, an answer that is not ours), nothing is said here and this Python's verdict stands.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["RanksVerdict", "ranks_python_path", "ask", "verdict_for", "ASK_TIMEOUT_S"]

ASK_TIMEOUT_S = 20.0  # a cold start on a network filesystem (as interpreter_check's probe)
MAX_ANSWER = 64 << 10

# Run by the ranks' Python: compiles the bytes on its stdin as py_compile compiles a file (BOM and coding
# line honoured) and prints one JSON object. Written for any Python 3.
CODE = r"""
import json, sys
v = "%d.%d.%d" % tuple(sys.version_info[:3])
try:
    compile(sys.stdin.buffer.read(), sys.argv[1], "exec", dont_inherit=True)
except SyntaxError as e:
    out = {"version": v, "kind": "syntax", "line": e.lineno, "offset": e.offset, "msg": str(e.msg or ""),
           "text": e.text if isinstance(e.text, str) else None}
except (ValueError, RecursionError, MemoryError) as e:
    out = {"version": v, "kind": "other", "msg": str(e) or type(e).__name__}
else:
    out = {"version": v, "kind": "ok"}
sys.stdout.write("hpc-ddp-compile " + json.dumps(out) + "\n")
"""


@dataclasses.dataclass(frozen=True)
class RanksVerdict:
    """What the ranks' Python said of the script: `error` None where it compiles, else the exception it
    gave, rebuilt here (a SyntaxError with its line and text, or a ValueError for a NUL byte and the like)."""

    python: str
    version: str
    error: BaseException | None


def ranks_python_path(spec: Any, environ: Mapping[str, str], executable: str | None = None) -> str | None:
    """The ranks' interpreter as a path on this machine, where it is another one than `executable` (this
    Python); None where it is the same, or cannot be known here."""
    if getattr(spec, "container", None):
        return None  # the image's Python
    python = spec.python
    if not python or not python.isprintable():
        return None
    if "/" not in python:
        if spec.setup:
            return None  # looked up on each node's PATH after the setup lines
        found = shutil.which(python, path=environ.get("PATH", os.defpath))
    else:
        found = os.path.join(spec.workdir, python)
    if not found or not os.path.isfile(found) or not os.access(found, os.X_OK):
        return None  # interpreter_check says why
    here = executable or sys.executable
    try:
        same = os.path.realpath(found) == os.path.realpath(here)  # a venv's python links to its base
    except (OSError, ValueError):
        return None
    return None if same else found


def ask(python: str, name: str, data: bytes, cwd: str, environ: Mapping[str, str],
        timeout: float = ASK_TIMEOUT_S, run: Callable[..., Any] = subprocess.run) -> RanksVerdict | None:
    """`python`'s verdict on `data`, the script `name`; None where it gave none we can read."""
    argv = [python, "-I", "-c", CODE, name]
    try:
        done = run(argv, cwd=cwd, env=dict(environ), input=data, capture_output=True, timeout=timeout)
    except (subprocess.TimeoutExpired, OSError, ValueError):
        return None
    return verdict_for(python, done.stdout[-MAX_ANSWER:] if isinstance(done.stdout, bytes) else b"")


def verdict_for(python: str, stdout: bytes) -> RanksVerdict | None:
    """The answer `CODE` printed, validated: a damaged or foreign one is None (no verdict), never an error."""
    line = next((ln for ln in reversed(stdout.decode("utf-8", "replace").splitlines())
                 if ln.startswith("hpc-ddp-compile ")), None)
    if line is None:
        return None
    try:
        out = json.loads(line[len("hpc-ddp-compile "):])
    except ValueError:
        return None
    if not isinstance(out, dict) or not isinstance(out.get("version"), str) or len(out["version"]) > 20:
        return None
    kind, msg = out.get("kind"), out.get("msg")
    version = out["version"]
    if kind == "ok":
        return RanksVerdict(python, version, None)
    if not isinstance(msg, str):
        return None
    msg = "".join(ch if ch.isprintable() else "?" for ch in msg[:300])  # it is shown in one line
    if kind == "syntax":
        line_no = out.get("line")
        offset = out.get("offset")
        text = out.get("text")
        line_no = line_no if isinstance(line_no, int) and not isinstance(line_no, bool) and 0 <= line_no < 10**9 \
            else None
        offset = offset if isinstance(offset, int) and not isinstance(offset, bool) and 0 <= offset < 10**9 \
            else None
        text = text[:300] if isinstance(text, str) else None
        return RanksVerdict(python, version, SyntaxError(msg, (None, line_no, offset, text)))
    if kind == "other":
        return RanksVerdict(python, version, ValueError(msg))
    return None
