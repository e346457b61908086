"""Which Python every rank runs (pure): the one the user named, else the environment they work in, else
the one running hpc-ddp; and the line that says which and why.

    --python / `python =` in the job file or profile     what the user named wins (spec layers)
    $VIRTUAL_ENV/bin/python                              the active venv: where the user's packages are
    $CONDA_PREFIX/bin/python                             the active conda env
    sys.executable                                       hpc-ddp's own; under pipx, pipx's private venv,
                                                         which has none of the user's packages

A venv's `bin/python` is a symlink to the base interpreter, and only its path makes it the venv's:
paths are never resolved here. Whether the chosen one works (exists, runs, imports hpc_ddp) is checked
on the login node before anything queues: `checks.interpreter_check`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["Interpreter", "choose", "explain", "NAMED"]

NAMED = "named by --python, or a `python` key of the job file or profile"


@dataclasses.dataclass(frozen=True)
class Interpreter:
    path: str
    why: str  # for the user: "the active venv ($VIRTUAL_ENV)"


def choose(environ: Mapping[str, str], executable: str | None) -> Interpreter:
    """The default interpreter of the ranks when the user named none."""
    for var, what in (("VIRTUAL_ENV", "the active venv"), ("CONDA_PREFIX", "the active conda env")):
        prefix = environ.get(var, "")
        if prefix.strip() and "\0" not in prefix:
            return Interpreter(os.path.join(prefix, "bin", "python"), f"{what}, ${var}")
    if executable:
        return Interpreter(executable, "the Python running hpc-ddp: no venv or conda env is active")
    return Interpreter("python3", "no venv or conda env is active, and this Python does not know its own path")


def explain(spec: Any, environ: Mapping[str, str] | None = None, executable: str | None = None) -> str:
    """`python PATH (why)`: the line `submit` prints beside the executor it chose (`environ` and
    `executable` default to this process's, where `choose` looked)."""
    if getattr(spec, "container", None):
        return f"python {spec.python} (run inside the container, at that path there)"
    chosen = choose(os.environ if environ is None else environ, sys.executable if executable is None else executable)
    return f"python {spec.python} ({chosen.why if spec.python == chosen.path else NAMED})"
