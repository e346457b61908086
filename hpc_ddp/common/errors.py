"""The exception tree. The CLI translates it once, at its boundary.

    HpcDdpError                 internal or environmental failure: exit 1 with the cause
     ├── UserError              something the user asked for or wrote is wrong: exit 2, one line
     │    ├── SpecError         a flag, job file or profile value
     │    └── EnvError          the environment a rank was started in (e.g. no srun)
     └── SubmitError            the scheduler refused or failed
"""

from __future__ import annotations


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
