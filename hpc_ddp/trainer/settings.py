"""The Session's settings, checked once where the user's code passes them (`hpc_ddp.start(**settings)`, and
the two a loop may change mid-run), so a mistake is one UsageError line with the fix, before anything on
disk changes, never a traceback from deep inside or a silent meaning (-1 minutes as "every step", nan as
"never"). Pure."""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Mapping
from typing import Any

from hpc_ddp.trainer.interval import AUTO
from hpc_ddp.trainer.sessionbase import UsageError

__all__ = ["SETTINGS", "check_settings", "count_setting"]

# name -> what it takes, as the error says it
SETTINGS = {
    "checkpoint_every_steps": "a whole number of steps (0: none)",
    "checkpoint_every_minutes": 'a number of minutes (0: none), or "auto"',
    "keep": "a whole number of checkpoints to keep, 2 or more",
    "log_every": "a whole number of steps, 1 or more",
    "fingerprint": "a mapping of plain values (JSON: numbers, strings, lists) that must match on resume",
    "stop_lead_seconds": "a number of seconds, 0 or more",
    "stop_on_nonfinite": "True or False",
    "exit_on_stop": "True or False",
    "env": "a DistEnv (tests only)",
    "async_checkpoint": "True or False",
    "loggers": 'a list of logger names ("tensorboard", "wandb")',
}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    """A finite int or float (an int past a float's range, 10**400, is no number of seconds or minutes)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


def _refuse(name: str, value: Any) -> UsageError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."   # a 400-digit number is no line to read
    return UsageError(f"hpc_ddp.start({name}={shown}): {name} takes {SETTINGS[name]}",
                      hint=f"pass {name}= {SETTINGS[name]}")


def count_setting(name: str, value: Any, least: int) -> int:
    """A whole number setting (checkpoint_every_steps, log_every, keep), at least `least`."""
    if not _whole(value) or value < least:
        raise _refuse(name, value)
    return value


def _plain_table(value: Any) -> bool:
    """A table of JSON values (the fingerprint goes into every checkpoint's manifest as JSON)."""
    if not isinstance(value, Mapping):
        return False
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def check_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` as `Session(**settings)` takes them, each checked: an unknown name (with the nearest known
    one), a wrong type, a negative count, or a number that is nan or infinite is a UsageError."""
    for name in settings:
        if name not in SETTINGS:
            near = difflib.get_close_matches(name, list(SETTINGS), n=1)
            raise UsageError(f"hpc_ddp.start() takes no setting {name!r}",
                             hint=f"did you mean {near[0]}=?" if near else f"the settings are: {', '.join(SETTINGS)}")
    out = dict(settings)
    if "checkpoint_every_steps" in out:
        count_setting("checkpoint_every_steps", out["checkpoint_every_steps"], 0)
    if "checkpoint_every_minutes" in out:
        minutes = out["checkpoint_every_minutes"]
        if minutes != AUTO and (not _number(minutes) or minutes < 0):
            raise _refuse("checkpoint_every_minutes", minutes)
    if "keep" in out:
        count_setting("keep", out["keep"], 2)
    if "log_every" in out:
        count_setting("log_every", out["log_every"], 1)
    if "stop_lead_seconds" in out and (not _number(out["stop_lead_seconds"]) or out["stop_lead_seconds"] < 0):
        raise _refuse("stop_lead_seconds", out["stop_lead_seconds"])
    for name in ("stop_on_nonfinite", "exit_on_stop", "async_checkpoint"):
        if name in out and not isinstance(out[name], bool):
            raise _refuse(name, out[name])
    if "fingerprint" in out and out["fingerprint"] is not None and not _plain_table(out["fingerprint"]):
        raise _refuse("fingerprint", out["fingerprint"])
    if "loggers" in out and (isinstance(out["loggers"], str)
                             or not all(isinstance(x, str) for x in out["loggers"] or ())):
        raise _refuse("loggers", out["loggers"])
    return out
