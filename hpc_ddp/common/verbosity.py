"""How much hpc-ddp says on stderr in this process: the `-q`/`-v` of the `hpc-ddp` group.

    QUIET    (-q)  errors and warnings only: no "executor sbatch (...)", no progress of a local run
    NORMAL         the informational lines too
    VERBOSE  (-v)  and detail: every command run (sbatch, squeue, the interpreter check), choices made

Errors never pass through here: `common.errors.report` prints them whatever the level. One process-wide
setting, because the lines come from everywhere on the login node (CLI, executors, the command runner);
ranks and batch scripts are other processes and keep the default.
"""

from __future__ import annotations

import sys

__all__ = ["QUIET", "NORMAL", "VERBOSE", "set_level", "level", "say", "info", "warning", "detail"]

QUIET, NORMAL, VERBOSE = -1, 0, 1
_level = NORMAL
# Lines already written as a finding ("warning: ...", "error: ...") are kept under -q.
_ALWAYS = ("warning:", "error:")


def set_level(value: int) -> None:
    global _level
    _level = max(QUIET, min(VERBOSE, value))


def level() -> int:
    return _level


def _emit(message: str) -> None:
    from hpc_ddp.common.terminal import printable

    print(f"hpc-ddp: {printable(message)}", file=sys.stderr, flush=True)  # names from files: shown, not obeyed


def say(message: str) -> None:
    """A line for the user: a warning if it says so ("warning: ..."), else information."""
    if message.startswith(_ALWAYS) or _level >= NORMAL:
        _emit(message)


def info(message: str) -> None:
    if _level >= NORMAL:
        _emit(message)


def warning(message: str) -> None:
    """Always shown: something may not do what the user means."""
    _emit(f"warning: {message}")


def detail(message: str) -> None:
    if _level >= VERBOSE:
        _emit(message)
