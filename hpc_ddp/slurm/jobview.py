"""What Slurm tells a job about itself, and what each Slurm version does next: the answers the requeue
policy (`job.attempts`) reads from inside the batch shell, parsed in one place.

- `slurm_job`: `scontrol show job ID` as fields (`parse_show_job`); `outside_cause` and `stopped_cause` read
  why the program ended from them (preempted, a time limit, a cancel, or the program's own doing).
- `down_nodes`: the nodes sinfo holds lost (`lost_state`).
- `accounted_end`: how sacct says the job's latest run ended, for a batch shell killed before it could say.
- `slurm_version` and `requeues_after_grace`: who requeues a job preempted with a GraceTime. Slurm 22.05
  to 23.11 end such a job when its batch script ends (hpc-ddp must requeue it); from 24.05 on (SchedMD's
  commit a689104d, bug 16263) Slurm requeues it itself, as PREEMPTED, once the script ends, whatever its
  exit code, where the job may be requeued and its preemption mode is REQUEUE. A `scontrol requeue` of
  ours on top of that leaves the grace flag set on 24.05 to 25.11, and Slurm then requeues the next run
  once more after it completed (SchedMD ticket 25682, fixed in 26.05): measured on 24.11.5, 2026-12-01.

The answers each version gives are recorded in tests/slurm/answers/ and the tests read them from there.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping

from hpc_ddp.common.errors import HpcDdpError
from hpc_ddp.common.procs import CommandRunner, SubprocessCommands
from hpc_ddp.slurm.jobstate import accounting

__all__ = ["ACCOUNTED_CAUSES", "GRACE_REQUEUE_SINCE", "accounted_end", "down_nodes", "grace_preempted", "lost_state",
           "silent_state",
           "outside_cause", "parse_show_job", "parse_version", "preempt_mode", "requeues_after_grace",
           "slurm_job", "slurm_stop", "slurm_version", "stopped_cause"]

# Lines of `scontrol show job` whose value is free text (a job name or path may hold " Restarts=9").
_FREE_TEXT = ("JobId", "Command", "WorkDir", "StdErr", "StdIn", "StdOut", "Comment", "AdminComment",
              "SystemComment", "Power", "MailUser", "Features", "Licenses")


def parse_show_job(text: str) -> dict[str, str]:
    """`scontrol show job ID` -> {field: value}. The lines that hold free text (the first, with the job
    name, and the paths) are skipped, so no name a user chose can pose as one of Slurm's fields."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].partition("=")[0] in _FREE_TEXT:
            continue
        for word in words:
            key, eq, value = word.partition("=")
            if eq and key[:1].isupper():
                fields.setdefault(key, value)
    return fields


_NONE = ("", "None", "Unknown", "N/A", "(null)")


def outside_cause(job: Mapping[str, str] | None, attempt: int, shell_signal: str | None) -> tuple[str, bool]:
    """Why an attempt whose program exited with an error ended: (cause, Slurm requeues it itself).

    `job` is Slurm's view from the batch shell (`parse_show_job`), None where it could not be asked;
    `attempt` the attempt's number (SLURM_RESTART_COUNT); `shell_signal` a signal the batch shell trapped.
    The table in the module docstring is what this reads."""
    if not job:
        return ("preempted" if shell_signal else "failed"), False
    if _int(job.get("Restarts")) > attempt:
        return "preempted", True
    if job.get("PreemptTime", "None") not in _NONE:
        return "preempted", False
    if job.get("Reason") == "TimeLimit" or job.get("JobState") == "TIMEOUT":
        return "time_limit", False
    if job.get("JobState") in ("CANCELLED", "COMPLETING") and (shell_signal or job.get("JobState") == "CANCELLED"):
        return "cancelled", False
    return "failed", False


def stopped_cause(job: Mapping[str, str] | None, attempt: int, shell_signal: str | None) -> tuple[str, bool]:
    """Why an attempt whose program exited 0 ended: (cause, Slurm requeues it itself).

    Exit 0 is not "done" by itself: Lightning catches SIGTERM and leaves through a SystemExit with no code,
    and a script that traps SIGTERM, saves and exits 0 is common. A stop that reached the program first
    (Slurm shows a preemption, a time limit or a cancel, as `outside_cause` reads them; or, without Slurm's
    answer, the batch shell or launcher got SIGTERM) makes the attempt interrupted, to be run again within
    the caps; otherwise it completed."""
    cause, by_slurm = outside_cause(job, attempt, shell_signal)
    return ("completed", False) if cause == "failed" else (cause, by_slurm)


def slurm_stop(job: Mapping[str, str] | None, attempt: int) -> bool:
    """Slurm shows a stop of its own (preemption, requeue, time limit, cancel)."""
    return bool(job) and outside_cause(job, attempt, None)[0] != "failed"


# sinfo's node states (%T) that mean the node is lost to its jobs; a trailing "*" means not responding.
_LOST_STATES = ("down", "fail", "failing", "unknown")


def lost_state(state: str, silent: bool = False) -> bool:
    """Is a node in sinfo's extended state `state` (down, down*, idle*, fail, mixed+drain, ...) lost? Lost
    is what Slurm holds DOWN or FAIL. A trailing "*" (not responding: one missed ping, while the node may
    still run its jobs) counts too only with `silent`: where the question is why an attempt already died,
    not whether to give a running one up."""
    word = state.strip().lower()
    return word.split("+")[0].rstrip("~#!%$@^*-") in _LOST_STATES or (silent and silent_state(word))


def silent_state(state: str) -> bool:
    """Does sinfo's state say the node is not responding (a trailing "*")?"""
    word = state.strip().lower()
    return word.endswith("*") or word.split("+")[0] == "not_responding"


# An attempt that left no end record (its batch shell was killed first) ended this way, where Slurm's accounting
# says so of the job's run (sacct -D); any other state, or no accounting, leaves it "killed".
ACCOUNTED_CAUSES = {"PREEMPTED": "preempted", "TIMEOUT": "time_limit", "NODE_FAIL": "node_failure"}


def accounted_end(job_id: str | None, commands: CommandRunner | None = None) -> str | None:
    """How Slurm's accounting says the latest ended run of `job_id` ended (PREEMPTED, TIMEOUT, NODE_FAIL,
    REQUEUED, ...): with -D each run of a requeued job is a record, and the one running now is left out.
    None without sacct, accounting or an answer within its timeout."""
    if not job_id:
        return None
    try:
        runs = accounting([job_id], commands or SubprocessCommands(), history=True).get(job_id, [])
    except HpcDdpError:
        return None
    ended = [run["state"] for run in runs if run["state"] not in ("RUNNING", "PENDING", "REQUEUE_HOLD")]
    return ended[-1] if ended else None


def down_nodes(nodelist: str | None, run=subprocess.run, *, silent: bool = False) -> list[str]:
    """The nodes of `nodelist` (Slurm's hostlist) that Slurm holds lost now (`lost_state`; with `silent`, not
    responding too), sorted; [] when none, or when Slurm cannot be asked."""
    if not nodelist or not shutil.which("sinfo"):
        return []
    try:
        done = run(["sinfo", "-h", "-N", "-n", nodelist, "-o", "%N|%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    lost = {name for name, _, state in (line.partition("|") for line in done.stdout.splitlines())
            if lost_state(state, silent)}
    return sorted(lost)


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0


def slurm_job(job_id: str | None, run=subprocess.run) -> dict[str, str] | None:
    """Slurm's record of `job_id` (`scontrol show job`), or None when it cannot be had."""
    if not job_id:
        return None
    try:
        done = run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_show_job(done.stdout) or None if done.returncode == 0 else None


# ---- who requeues a job preempted with a GraceTime ----

# From this release on Slurm requeues a job preempted in its GraceTime itself, once its batch script ends.
GRACE_REQUEUE_SINCE = (24, 5)


def parse_version(text: str) -> tuple[int, int] | None:
    """(major, minor) from what `scontrol --version` prints ("slurm 24.11.5", "slurm-wlm 26.05.5"); None for
    anything else."""
    found = re.fullmatch(r"\s*slurm(?:-wlm)?\s+(\d{2})\.(\d{2})(?:\.\d+)*\S*\s*", text or "")
    return (int(found.group(1)), int(found.group(2))) if found else None


def slurm_version(run=subprocess.run) -> tuple[int, int] | None:
    """The Slurm release of this node's commands (`scontrol --version`), or None. A node's release is never
    newer than the controller's (Slurm upgrades slurmctld first), so it is a floor for what the controller
    does."""
    try:
        done = run(["scontrol", "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_version(done.stdout) if done.returncode == 0 else None


def grace_preempted(job: Mapping[str, str] | None, attempt: int) -> bool:
    """Slurm shows this attempt preempted and still in its GraceTime: RUNNING with a PreemptTime, not yet
    requeued (with GraceTime 0 Slurm has requeued it already: COMPLETING, Restarts past the attempt)."""
    return bool(job) and job.get("JobState") == "RUNNING" and job.get("PreemptTime", "None") not in _NONE \
        and _int(job.get("Restarts")) <= attempt


def preempt_mode(partition: str | None, run=subprocess.run) -> str | None:
    """The PreemptMode of `partition` (`scontrol show partition -o`: REQUEUE, CANCEL, "GANG,REQUEUE", ...),
    upper case, or None where it cannot be had."""
    if not partition or not re.fullmatch(r"[\w.-]{1,128}", partition):
        return None
    try:
        done = run(["scontrol", "show", "partition", partition, "-o"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"(?:^|\s)PreemptMode=(\S+)", done.stdout) if done.returncode == 0 else None
    return found.group(1).upper() if found else None


def requeues_after_grace(job: Mapping[str, str] | None, attempt: int, version: tuple[int, int] | None,
                         mode: str | None) -> bool:
    """Will Slurm requeue this attempt's job itself once its batch script ends? Only a job preempted in its
    GraceTime (`grace_preempted`) on Slurm 24.05 or later (`version`), that may be requeued (Requeue=1),
    in preemption mode REQUEUE (`mode`, its partition's). Where any of that is unknown: no, and hpc-ddp
    requeues it (a second requeue by Slurm after all is caught at the next begin: the run completed)."""
    return grace_preempted(job, attempt) and version is not None and version >= GRACE_REQUEUE_SINCE \
        and (job or {}).get("Requeue") == "1" and mode is not None and "REQUEUE" in mode.split(",")
