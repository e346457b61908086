"""The exception tree, and the one translation of an error into a line and an exit code (`report`),
used at every process boundary: the CLI, the per-rank runner, the requeue policy's hook, the trainer
and a user's script that uses the Session API.

    HpcDdpError                 internal or environmental failure: exit 1 with the cause
     ├── UserError              something the user asked for or wrote is wrong: exit 2, one line
     │    ├── SpecError         a flag, job file or profile value
     │    └── EnvError          the environment a rank was started in (e.g. no srun)
     └── SubmitError            the scheduler refused or failed
"""

from __future__ import annotations

import os
import sys
import traceback


class HpcDdpError(Exception):
    """Base of every error hpc-ddp raises on purpose. `hint` names the fix, when there is one."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} HINT: {self.hint}" if self.hint else self.message


class UserError(HpcDdpError):
    exit_code = 2


class SpecError(UserError):
    """A bad value in a flag, job file or profile."""


class EnvError(UserError):
    """The process environment cannot give a consistent distributed setup."""


class SubmitError(HpcDdpError):
    """The scheduler (or a local launch) failed."""


def report(exc: BaseException, who: str = "hpc-ddp", *, traceback_for_bugs: bool = False) -> int:
    """Print the one line `exc` leaves a process with (on stderr, secrets masked) and return its exit code.

    Ours (HpcDdpError): the message and its hint, exit 2 for the user's mistakes, 1 for the rest. An
    OSError is the environment's (a full disk, a run dir gone): its text, exit 1. Anything else is a bug:
    "internal error: Type: message", exit 1, with the traceback where a log is the place to debug it
    (`traceback_for_bugs`, the ranks) or HPC_DDP_DEBUG is set."""
    from hpc_ddp.common import secrets

    if isinstance(exc, HpcDdpError):
        line, code = str(exc), exc.exit_code
    elif isinstance(exc, OSError):
        line, code = str(exc), 1
    else:
        shown = traceback_for_bugs or bool(os.environ.get("HPC_DDP_DEBUG"))
        if shown:
            traceback.print_exception(exc)
        line = f"internal error: {type(exc).__name__}: {exc}" + ("" if shown else
                                                                  " (set HPC_DDP_DEBUG=1 for the traceback)")
        code = 1
    from hpc_ddp.common.terminal import printable

    # a message quotes what came from files, records and the other side of ssh: shown, never obeyed, on one line
    print(f"{who}: error: {printable(secrets.current()(line)).replace(chr(10), ' ')}", file=sys.stderr, flush=True)
    return code
