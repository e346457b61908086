"""`checkpoint_every_minutes = "auto"` (issue 44): the periodic checkpoint interval from Young's formula,

    interval = sqrt(2 x w / lambda)

w: the blocking cost of one save in seconds, as the Session measured it (the snapshot to host memory for a
background save, the whole write otherwise; DEFAULT_SAVE_S until this attempt has saved once); lambda: the
job's interruptions per second, N nodes x the per-node rate r. r is the interruptions over the node-hours
of three sources added together (a Gamma-Poisson estimate, so a short history gives neither 0 nor
infinity):

- the prior: PRIOR_INTERRUPTIONS in PRIOR_NODE_HOURS (one interruption per 24 node-hours), always there;
- the run's own history (events.jsonl): its attempts that ended preempted, by a node failure, killed from
  outside without an end record, or at a time limit without a checkpoint, over the node-hours they ran;
- where Slurm's accounting answers, the partition's jobs of the last SACCT_DAYS days: those that ended
  PREEMPTED or NODE_FAIL, over the node-hours all its jobs ran (`sacct`, once per attempt, on rank 0 only,
  bounded by SACCT_TIMEOUT_S; where it is missing or fails, the record says so and the others serve).

The interval is clamped to at least MIN_FACTOR x w and MIN_S, and to at most MAX_S and the time the job
has left. What a record says is checked where it is read (`_time`, `parse_sacct`): a damaged one is left
out, counted in its source's note, and never reaches the arithmetic.
It is chosen when an attempt starts (and again once its first save is measured, and when sacct answers);
each choice is one `checkpoint_interval` event, which `status` shows. The arithmetic here is pure; the
sacct call takes its runner as an argument.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["AUTO", "DEFAULT_SAVE_S", "MIN_FACTOR", "MIN_S", "PRIOR_INTERRUPTIONS", "PRIOR_NODE_HOURS",
           "SACCT_DAYS", "SACCT_TIMEOUT_S", "Evidence", "young", "per_node_rate", "choose", "from_history",
           "parse_sacct", "from_sacct"]

AUTO = "auto"
DEFAULT_SAVE_S = 5.0         # w before this attempt's first save is measured
MIN_FACTOR = 10.0            # never save more often than every 10 x w (at most 10% of the time saving)
MIN_S = 60.0                 # nor more often than once a minute
PRIOR_INTERRUPTIONS = 1.0    # the prior: 1 interruption ...
PRIOR_NODE_HOURS = 24.0      # ... per 24 node-hours
SACCT_DAYS = 7
SACCT_TIMEOUT_S = 10.0
INTERRUPTED = ("preempted", "node_failure", "killed")
# Nor less often than every 6 hours: the rate is an estimate (a quiet week of the partition, a history of
# long clean attempts), and an interruption that comes anyway should never cost more than that.
MAX_S = 6 * 3600.0
# What a record may say, read at the edge: an attempt or a sacct job longer than a year, or on more nodes
# than any job has, is a damaged record, left out (and counted in the source's note), never summed in.
MAX_RECORD_S = 365 * 86400.0
MAX_RECORD_NODES = 100_000


@dataclasses.dataclass(frozen=True)
class Evidence:
    """Interruptions seen over node-hours run, from one source."""
    source: str              # "prior", "history" or "sacct"
    interruptions: float
    node_hours: float
    note: str = ""

    def record(self) -> dict[str, Any]:
        return {"interruptions": self.interruptions, "node_hours": round(self.node_hours, 3),
                **({"note": self.note} if self.note else {})}


PRIOR = Evidence("prior", PRIOR_INTERRUPTIONS, PRIOR_NODE_HOURS, "one interruption per 24 node-hours")


def young(save_s: float, rate_per_s: float) -> float:
    """Young's optimum: sqrt(2 w / lambda) seconds between checkpoints."""
    return math.sqrt(2.0 * save_s / rate_per_s)


def per_node_rate(evidence: Iterable[Evidence]) -> float:
    """Interruptions per node-hour, all sources together (the prior included by the caller)."""
    items = list(evidence)
    hours = sum(e.node_hours for e in items)
    return sum(e.interruptions for e in items) / hours if hours > 0 else PRIOR_INTERRUPTIONS / PRIOR_NODE_HOURS


def choose(*, save_s: float | None, nodes: int, evidence: Sequence[Evidence],
           time_left_s: float | None = None) -> dict[str, Any]:
    """The interval and why: the `checkpoint_interval` event's fields (see docs/preemption.md)."""
    measured = save_s is not None
    w = save_s if measured else DEFAULT_SAVE_S
    w = max(w, 1e-3)
    sources = [PRIOR, *[e for e in evidence if e.source != "prior"]]
    rate_node_h = per_node_rate(e for e in sources if e.node_hours > 0 or e.source == "prior")
    rate_s = max(1, nodes) * rate_node_h / 3600.0
    raw = young(w, rate_s)
    seconds, clamped = raw, None
    floor = max(MIN_FACTOR * w, MIN_S)
    if seconds < floor:
        seconds, clamped = floor, f"at least {MIN_FACTOR:g} x the save and {MIN_S:g} s"
    if seconds > MAX_S:
        seconds, clamped = MAX_S, f"at most {MAX_S / 3600:g} h"
    if time_left_s is not None and time_left_s > 0 and seconds > time_left_s:
        seconds, clamped = time_left_s, "at most the time the job has left"
    why = (f"Young: sqrt(2 x {w:.3g} s save{'' if measured else ' (estimate)'} / "
           f"{rate_s * 3600:.3g} interruptions/h ({max(1, nodes)} node{'s' if nodes != 1 else ''} x "
           f"{rate_node_h:.3g}/node-h)) = {raw / 60:.3g} min" + (f", clamped to {seconds / 60:.3g} min ({clamped})"
                                                                 if clamped else ""))
    return {"event": "checkpoint_interval", "seconds": round(seconds, 1), "minutes": round(seconds / 60, 2),
            "save_s": round(w, 3), "save_measured": measured, "nodes": max(1, nodes),
            "rate_per_node_hour": round(rate_node_h, 6), "young_s": round(raw, 1), "clamped": clamped,
            "sources": {e.source: e.record() for e in sources}, "why": why}


# ---- the run's own history ----

def _node_count(nodes: str | None, default: int) -> int:
    if not nodes:
        return default
    from hpc_ddp.common.errors import HpcDdpError
    from hpc_ddp.slurm.nodelist import expand_hostlist

    try:  # a damaged record's hostlist (one that is not Slurm's, or past expand_hostlist's bound) says nothing
        return max(1, len(expand_hostlist(nodes)))
    except (ValueError, HpcDdpError):
        return default


def from_history(events: Sequence[Mapping[str, Any]], *, nodes: int, now: float) -> Evidence:
    """Interruptions over node-hours of the attempts in the run dir's events (every submission of it):
    an attempt that ended preempted, by a node failure, with no end record (killed from outside), or at a
    time limit without saving at its stop. The attempt running now is not counted (it has not ended)."""
    from hpc_ddp.job.attempts import attempts_from_events

    count, hours, dropped = 0, 0.0, 0
    attempts = attempts_from_events(list(events))
    for attempt in attempts:
        if attempt.started_at is None or attempt.ended_at is None:
            continue  # never started, or this attempt, still running
        started, ended = _time(attempt.started_at), _time(attempt.ended_at)
        if started is None or ended is None or not 0 <= ended - started <= MAX_RECORD_S or ended > now + 86400:
            dropped += 1  # a damaged record: a time that is no number, or a span no attempt had
            continue
        hours += (ended - started) / 3600.0 * _node_count(attempt.nodes, nodes)
        cause = attempt.ended_cause
        if cause in INTERRUPTED or (cause == "time_limit" and not attempt.checkpointed):
            count += 1
    return Evidence("history", count, hours, f"{len(attempts)} attempts" + _dropped(dropped, "attempt"))


def _time(value: Any) -> float | None:
    """A record's time: a finite number of seconds, else None (a string, a bool, nan, 1e308's overflow)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)   # a 401-digit int overflows here: no time either
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def _dropped(count: int, what: str) -> str:
    return f"; {count} damaged {what}{'s' if count != 1 else ''} left out" if count else ""


# ---- Slurm's accounting ----

def parse_sacct(text: str, partition: str, me: str | None = None) -> Evidence:
    """`sacct -X -n -P -o State,NNodes,ElapsedRaw,User` lines -> PREEMPTED and NODE_FAIL endings over
    node-hours. Where every job seen is `me`'s, the note says so: a site with PrivateData=jobs shows a user
    only their own jobs (measured on the test Slurm: the same lines, fewer of them), so the rate is theirs."""
    count, hours, jobs, dropped = 0, 0.0, 0, 0
    users: set[str] = set()
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3:
            continue
        state, nnodes, elapsed = parts[0].split()[0] if parts[0].strip() else "", parts[1].strip(), parts[2].strip()
        if not (nnodes.isascii() and nnodes.isdigit() and elapsed.isascii() and elapsed.isdigit()) \
                or len(nnodes) > 7 or len(elapsed) > 12:
            dropped += bool(nnodes or elapsed)  # a header or an empty field is no job; a damaged one is counted
            continue
        n, seconds = int(nnodes), int(elapsed)
        if not 1 <= n <= MAX_RECORD_NODES or seconds > MAX_RECORD_S:
            dropped += 1
            continue
        jobs += 1
        hours += n * seconds / 3600.0
        if state in ("PREEMPTED", "NODE_FAIL"):
            count += 1
        if len(parts) > 3:
            users.add(parts[3].strip())
    own = " (yours only: the site may hide others' jobs, PrivateData=jobs)" if me and jobs and users == {me} else ""
    return Evidence("sacct", count, hours,
                    f"partition {partition}, {jobs} jobs in {SACCT_DAYS} days{own}" + _dropped(dropped, "line"))


def from_sacct(partition: str | None, run: Callable[..., Any] = subprocess.run,
               timeout: float = SACCT_TIMEOUT_S, me: str | None = None) -> Evidence:
    """The partition's recent interruption rate from sacct, or an Evidence of nothing whose note says why.
    `me`: the user's name (default: this process's), to say when only their own jobs were visible."""
    if not partition:
        return Evidence("sacct", 0, 0.0, "no partition (not a Slurm job): not asked")
    command = ["sacct", "-X", "-n", "-P", "-a", "-r", partition, "-S", f"now-{SACCT_DAYS}days", "-E", "now",
               "-o", "State,NNodes,ElapsedRaw,User"]
    try:
        done = run(command, capture_output=True, text=True, errors="replace", timeout=timeout)
    except FileNotFoundError:
        return Evidence("sacct", 0, 0.0, "sacct not found: the run's history and the prior only")
    except subprocess.TimeoutExpired:
        return Evidence("sacct", 0, 0.0, f"sacct did not answer in {timeout:g} s: the run's history and the prior only")
    except OSError as exc:
        return Evidence("sacct", 0, 0.0, f"sacct failed ({exc.strerror}): the run's history and the prior only")
    if done.returncode != 0:
        first = (done.stderr or "").strip().splitlines()[:1]
        return Evidence("sacct", 0, 0.0, f"sacct failed ({first[0][:120] if first else f'exit {done.returncode}'}): "
                                         "the run's history and the prior only")
    return parse_sacct(done.stdout, partition, me if me is not None else _user())


def _user() -> str | None:
    import getpass

    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return None
