"""Slurm time strings <-> seconds. Pure.

Slurm accepts "M", "M:S", "H:M:S", "D-H", "D-H:M" and "D-H:M:S" (sbatch(1) --time), and
"UNLIMITED"/"INFINITE" for no limit.
"""

from __future__ import annotations

import re

from hpc_ddp.common.errors import SpecError

__all__ = ["parse_time", "format_time"]

_FORMS = [
    (re.compile(r"^(\d+)$"), ("m",)),
    (re.compile(r"^(\d+):(\d+)$"), ("m", "s")),
    (re.compile(r"^(\d+):(\d+):(\d+)$"), ("h", "m", "s")),
    (re.compile(r"^(\d+)-(\d+)$"), ("d", "h")),
    (re.compile(r"^(\d+)-(\d+):(\d+)$"), ("d", "h", "m")),
    (re.compile(r"^(\d+)-(\d+):(\d+):(\d+)$"), ("d", "h", "m", "s")),
]
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_ACCEPTED = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"


def parse_time(text: str | int) -> int | None:
    """Seconds for a Slurm time limit; None for no limit. Raises SpecError naming the accepted forms."""
    raw = str(text).strip()
    if raw.upper() in ("UNLIMITED", "INFINITE"):
        return None
    for pattern, units in _FORMS:
        m = pattern.match(raw)
        if m:
            seconds = sum(int(v) * _SECONDS[u] for v, u in zip(m.groups(), units))
            if seconds <= 0:
                raise SpecError(f"time {raw!r} is zero", hint=f"give a positive limit ({_ACCEPTED})")
            return seconds
    raise SpecError(f"time {raw!r} is not a Slurm time", hint=f"use one of {_ACCEPTED}, e.g. 2:00:00")


def format_time(seconds: int) -> str:
    """Seconds -> D-HH:MM:SS (always accepted by Slurm). Slurm rounds partial minutes up."""
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
