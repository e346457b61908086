"""The requeue policy, pure: the attempts a run dir's records tell of, and what to do after one ends.

`attempts_from_events` reads the records (events.jsonl) into `Attempt`s; `decide_begin` says whether a new
attempt may run, `decide_end` whether an ended one is requeued, `decide_restart` whether a step that crashed
or lost a node restarts inside its allocation, and `decide_successor` what a later job of a chain does. No
file, process or Slurm is touched here: `job.attempts` is the edge that reads, asks Slurm and records
(its docstring tells the whole protocol), and `slurm.jobview` what Slurm's answers mean.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE

__all__ = ["Attempt", "Limits", "STARTUP_S", "UNRECORDED_CAUSES", "attempts_from_events", "current_job",
           "decide_begin", "decide_end", "decide_restart", "decide_successor", "limits_of"]

# An attempt of a user's own script (no trainer events) counts as having trained once it ran this long.
STARTUP_S = 60.0
# Causes an attempt with no end record may still be given (by the next begin, from what Slurm says).
UNRECORDED_CAUSES = ("node_failure", "preempted", "time_limit")


@dataclasses.dataclass(frozen=True)
class Limits:
    max_requeues: int = 10        # requeues after time limits
    max_preemptions: int = 20     # requeues after preemptions (and outside kills)
    max_restarts: int = 0         # restarts inside the allocation per attempt (rank crash, lost node)


# The record `hpc-ddp preempt --signal TERM` leaves before it signals ranks that are not here (Slurm knows
# nothing of a rehearsal): the attempt it reached ends preempted, however its program leaves.
REHEARSED = "preempt_rehearsed"


@dataclasses.dataclass
class Attempt:
    number: int
    start_step: int | None         # newest valid checkpoint when the attempt began
    trainer: bool = False          # the built-in trainer reported start/resume in this attempt
    exit_code: int | None = None   # None: no end record (killed from outside)
    cause: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    checkpointed: bool = False     # the trainer saved at a stop request and asked to be requeued
    job_id: str | None = None
    handed_over: bool = False      # went on in the next job of its chain, queued up front (--chain)
    finished: bool = False         # the trainer or a Session recorded the run's finish in this attempt
    warned: bool = False           # the time-limit warning reached a handler of the program's own
    gave_up: str | None = None     # the policy's reason for stopping the run after this attempt
    code: str | None = None        # the id of the code snapshot it ran (snapshot.snapshot)
    nodes: str | None = None       # the nodes it ran on (SLURM_JOB_NODELIST)
    restarts: int = 0              # restarts inside the allocation so far ("restarted" records)
    step_nodes: str | None = None  # the nodes of its current srun step, after a restart (comma-separated)
    step_started_at: float | None = None   # when its current srun step began, after a restart
    step_start_step: int | None = None     # the checkpoint step its current srun step resumed from
    rehearsed: bool = False        # `hpc-ddp preempt --signal TERM` was sent to its ranks (a rehearsal)

    @property
    def step_trained(self) -> bool:
        """The current srun step got past start-up: the trainer began its loop, or it ran for a while."""
        if self.trainer:
            return True
        began = self.step_started_at if self.step_started_at is not None else self.started_at
        if began is None or self.ended_at is None:
            return False
        return self.ended_at - began >= STARTUP_S

    @property
    def trained(self) -> bool:
        """Got past start-up: the trainer began its loop, or (a user's script) it ran for a while."""
        if self.trainer:
            return True
        if self.started_at is None or self.ended_at is None:
            return False
        return self.ended_at - self.started_at >= STARTUP_S

    @property
    def ended_cause(self) -> str:
        if self.exit_code is None:  # no end record: the next begin (`admit`) asks Slurm why (a lost node, or
            return self.cause if self.cause in UNRECORDED_CAUSES else "killed"  # its accounting); else killed
        return self.cause or ("completed" if self.exit_code == 0 else "failed")


def attempts_from_events(events: Sequence[dict[str, Any]], chain: str | None = None) -> list[Attempt]:
    """The attempts recorded in `events`; with `chain` (a job id, or the first job id of a chain), only
    those of that job and of the jobs that carried on after it. A new submission of the same run dir is a
    new chain: an earlier chain's failures do not stop it."""
    attempts: list[Attempt] = []
    for event in _of_chain(events, chain):
        kind = event.get("event")
        if kind == "attempt_start":
            if attempts and attempts[-1].ended_at is None:
                attempts[-1].ended_at = event.get("time")  # killed: it ended before this one began
            attempts.append(Attempt(int(event.get("attempt", len(attempts))), event.get("checkpoint_step"),
                                    started_at=event.get("time"), job_id=event.get("job_id"),
                                    code=event.get("code") if isinstance(event.get("code"), str) else None,
                                    nodes=event.get("nodes") if isinstance(event.get("nodes"), str) else None))
        elif not attempts:
            continue
        elif kind in ("start", "resume"):
            attempts[-1].trainer = True
        elif kind == "finish":
            attempts[-1].finished = True
        elif kind == "warned":
            attempts[-1].warned = True
        elif kind == "signal":
            attempts[-1].cause = event.get("cause")
        elif kind == REHEARSED:
            attempts[-1].rehearsed = True
        elif kind == "requeue_requested":
            attempts[-1].checkpointed = True
        elif kind == "attempt_end" and _ended(attempts, event).exit_code is None:
            which = _ended(attempts, event)
            which.exit_code = event.get("exit_code")
            which.cause = event.get("cause") or which.cause
            which.ended_at = event.get("time") or which.ended_at
        elif kind == "requeue" and event.get("by") == "chain":
            attempts[-1].handed_over = True
        elif kind == "gave_up":
            attempts[-1].gave_up = str(event.get("reason") or "gave up")
        elif kind == "restarted":  # a new srun step of the same attempt: what is known of the step starts over
            a = attempts[-1]
            a.restarts += 1
            a.trainer = a.checkpointed = a.finished = a.warned = a.rehearsed = False
            a.cause = None
            a.step_started_at = event.get("time")
            a.step_nodes = event.get("nodes") if isinstance(event.get("nodes"), str) else a.step_nodes
            a.step_start_step = event.get("checkpoint_step")
    return attempts


def _ended(attempts: list[Attempt], event: dict[str, Any]) -> Attempt:
    """The attempt an attempt_end record is about: the last one, or the one before it when the record names
    it (the next attempt's begin records how a killed attempt ended, after its own start)."""
    if len(attempts) > 1 and event.get("exit_code") is None and event.get("attempt") == attempts[-2].number \
            and attempts[-1].number != attempts[-2].number:
        return attempts[-2]
    return attempts[-1]


def _of_chain(events: Sequence[dict[str, Any]], chain: str | None) -> list[dict[str, Any]]:
    """The events from the chain's first attempt on. Records from before chains were recorded have no
    "chain": their job id is their chain."""
    if chain is None:
        return list(events)
    starts = [i for i, e in enumerate(events)
              if e.get("event") == "attempt_start" and str(e.get("chain") or e.get("job_id")) == chain]
    return list(events[starts[0]:]) if starts else []


def current_job(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the newest job in the run dir (from its first attempt): a job submitted again to
    resume is judged on its own, not on why the one before it stopped."""
    starts = [e for e in events if e.get("event") == "attempt_start"]
    if not starts:
        return events
    job = starts[-1].get("job_id")
    first = next(i for i, e in enumerate(events) if e.get("event") == "attempt_start" and e.get("job_id") == job)
    return events[first:]


def _count(attempts: Sequence[Attempt], *causes: str) -> int:
    # A time limit handed over to the next job of a --chain is planned, not a requeue to be capped.
    return sum(1 for a in attempts if a.ended_cause in causes and not (a.handed_over and a.ended_cause == "time_limit"))


def decide_successor(previous: Sequence[Attempt], cancelled: str | None = None) -> tuple[str, str] | None:
    """A later job of a chain, before `decide_begin`: ("done", why) when the run completed in an earlier
    job, ("stop", why) when the policy stopped it there or `cancelled` (a job of the chain that
    `hpc-ddp cancel` cancelled), None when the usual rules decide."""
    if cancelled:
        return "stop", f"job {cancelled} of the chain was cancelled (hpc-ddp cancel)"
    if not previous:
        return None  # the jobs before it never ran (cancelled while pending): this one starts the run
    last = previous[-1]
    where = f" in job {last.job_id}" if last.job_id else " in an earlier job of the chain"
    if last.ended_cause == "completed":
        return "done", f"the run already completed{where}; nothing left to do"
    if last.gave_up:
        return "stop", f"the run stopped{where}: {last.gave_up}"
    return None


def decide_begin(previous: Sequence[Attempt], start_step: int | None, limits: Limits) -> tuple[bool, str]:
    """May a new attempt run, given the ones before it? (ok, reason)."""
    if not previous:
        return True, "first attempt"
    last = previous[-1]
    if last.ended_cause == "completed":
        return False, "the job already completed; requeued by mistake?"
    if last.ended_cause == "failed":
        return False, f"the previous attempt failed (exit code {last.exit_code}); not running again"
    if last.ended_cause == "cancelled":
        return False, "the job was cancelled; not running again"
    # An attempt killed or signalled from outside (node failure, preemption, admin requeue) is not the
    # job's fault: it only counts against max_preemptions. The no-progress guard judges attempts that
    # asked to be requeued themselves (exit 75) without having moved the checkpoint on.
    if last.exit_code == REQUEUE_EXIT_CODE and last.trainer and start_step == last.start_step:
        return False, f"no progress: the previous attempt started and ended at checkpoint step {start_step}"
    preempted = _count(previous, "preempted", "killed")
    if preempted > limits.max_preemptions:
        return False, f"preempted {preempted} times, more than max_preemptions={limits.max_preemptions}"
    failed_nodes = _count(previous, "node_failure")
    if failed_nodes > limits.max_requeues:
        return False, f"lost a node {failed_nodes} times, more than max_requeues={limits.max_requeues}"
    timeouts = _count(previous, "time_limit")
    if timeouts > limits.max_requeues:
        return False, f"hit the time limit {timeouts} times, more than max_requeues={limits.max_requeues}"
    return True, f"restart {len(previous)} after {last.ended_cause}"


def decide_end(attempts: Sequence[Attempt], exit_code: int, limits: Limits,
               successor: str | None = None) -> tuple[bool, str]:
    """Should the job be requeued after this attempt (the last of `attempts`)? (requeue, reason).
    An exit code other than 0 and 75 is requeued only when the attempt's cause says it came from
    outside (preempted, time_limit: see `outside_cause`). `successor`: the next job of the chain, queued
    up front and waiting; the run goes on there instead (a time limit then counts against no cap)."""
    cause = attempts[-1].cause
    if exit_code == 0 and cause not in ("preempted", "time_limit", "cancelled"):
        return False, "completed"
    if cause == "cancelled":
        return False, "cancelled"
    if exit_code != REQUEUE_EXIT_CODE and cause not in ("preempted", "time_limit", "node_failure"):
        return False, f"failed with exit code {exit_code}"
    if exit_code == REQUEUE_EXIT_CODE and not attempts[-1].trained:
        return False, "it asked to be requeued before training started (crash loop guard)"
    cause = cause or "preempted"
    if cause == "time_limit" and successor:
        return True, f"time_limit: job {successor}, queued after this one, goes on"
    if cause == "time_limit":
        used, cap, name = _count(attempts, "time_limit"), limits.max_requeues, "max_requeues"
    elif cause == "node_failure":  # a lost node: the next attempt runs on the nodes that are up
        used, cap, name = _count(attempts, "node_failure"), limits.max_requeues, "max_requeues"
    else:
        used, cap, name = _count(attempts, "preempted", "killed"), limits.max_preemptions, "max_preemptions"
    if used > cap:
        return False, f"{cause}: {used} requeues would exceed {name}={cap}"
    return True, f"{cause}: requeue {used} of at most {cap}" + (f", in job {successor}" if successor else "")


def decide_restart(last: Attempt, limits: Limits, *, healthy: Sequence[str], min_nodes: int,
                   checkpoint_step: int | None) -> tuple[bool, str]:
    """Restart the attempt `last` (its step just ended, `last.cause` says why) inside its allocation, on the
    nodes in `healthy` (the allocation's, less those Slurm holds lost)? (restart, reason). `min_nodes`: the
    fewest nodes the job runs on (a range's MIN; a fixed size's count, so it restarts only on all of them).
    Only a crash ("failed") or a lost node is restarted so: a preemption, a time limit or a cancel ends the
    allocation anyway."""
    cause = last.cause or "failed"
    if limits.max_restarts <= 0:
        return False, "restarts inside the allocation are off (max_restarts=0)"
    if cause not in ("failed", "node_failure"):
        return False, f"{cause}: the allocation ends, nothing to restart in"
    if last.restarts >= limits.max_restarts:
        return False, f"{cause}: restarted in place {last.restarts} time(s) already, max_restarts={limits.max_restarts}"
    if cause == "failed" and not last.step_trained:
        return False, "it failed before training started: a restart would fail the same way (crash loop guard)"
    if cause == "failed" and last.restarts and last.trainer and checkpoint_step == last.step_start_step:
        return False, f"it failed again before checkpointing past step {checkpoint_step} (no progress since the restart)"
    if len(healthy) < min_nodes:
        return False, f"{cause}: {len(healthy)} healthy node(s) left in the allocation, the job needs {min_nodes}"
    return True, (f"{cause}: restart {last.restarts + 1} of at most {limits.max_restarts} in the allocation, "
                  f"on {len(healthy)} node(s)")


def limits_of(spec) -> Limits:
    """The caps a JobSpec sets."""
    return Limits(spec.max_requeues, spec.max_preemptions, getattr(spec, "max_restarts", 0))
