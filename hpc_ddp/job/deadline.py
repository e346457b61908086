"""When does this job's time run out, and how long before that must training stop?

The end time comes from HPC_DDP_DEADLINE (set by the local executor for --time) or from Slurm
(`squeue -o %e`). The lead is measured, not guessed: twice the last checkpoint's save time plus three
steps plus a margin, never below a floor, unless the job file fixes it (stop_lead_seconds). Slurm's own
warning signal (--signal, which may come up to 60 s early or late) remains the backstop.
"""

from __future__ import annotations

import datetime as _dt
import subprocess
from collections.abc import Mapping

__all__ = ["job_deadline", "stop_lead", "LEAD_FLOOR_S", "LEAD_MARGIN_S"]

LEAD_FLOOR_S = 30.0
LEAD_MARGIN_S = 30.0


def stop_lead(save_seconds: float | None, step_seconds: float | None, fixed: float = 0.0) -> float:
    if fixed:
        return fixed
    measured = 2 * (save_seconds or 0.0) + 3 * (step_seconds or 0.0) + LEAD_MARGIN_S
    return max(LEAD_FLOOR_S, measured)


def job_deadline(env: Mapping[str, str], run=subprocess.run) -> float | None:
    """The job's end time (epoch seconds), or None when it has no limit or it cannot be found."""
    if env.get("HPC_DDP_DEADLINE"):
        return float(env["HPC_DDP_DEADLINE"])
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_slurm_timestamp(out.strip())


def parse_slurm_timestamp(text: str) -> float | None:
    """'2026-11-22T07:00:00' (local time, as Slurm prints it) -> epoch seconds; N/A, NONE, Unknown -> None."""
    try:
        return _dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None
