"""What the Session API's parts share (session.py, sessionsave.py, sessionstep.py): the errors its misuse
and a diverged loss raise, and the run's Progress as a checkpoint saves it. Re-exported by session.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from hpc_ddp.common.errors import HpcDdpError, UserError


class UsageError(UserError):
    """The API was called in a way that cannot work; the message names the fix."""


class IncompatibleResume(UserError):
    """The checkpoint was made by a run this one differs from (world size, settings, schedule)."""


class Diverged(HpcDdpError):
    """The loss became NaN or infinite: stop without a checkpoint and without a requeue (exit 1)."""


@dataclasses.dataclass
class Progress:
    step: int = 0               # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0     # batches of this epoch already consumed, per rank
    restarts: int = 0           # resumes from a checkpoint so far
    samples: int = 0            # samples consumed, all ranks together (where step() is told)


def at_least_one(what: str, **values: Any) -> None:
    """A count the API is given must be a whole number >= 1: 0 or -2 would train or count nothing, in silence."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{what}(): {name}={value!r} is not a whole number of at least 1",
                             hint=f"pass {name}= 1 or more")
