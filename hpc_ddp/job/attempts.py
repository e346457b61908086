"""The requeue policy: what each attempt of a job was, why it ended, and whether to run another.

The batch script (and the local executor) call this at the start and the end of every attempt:

    python -m hpc_ddp.job.attempts begin RUN_DIR ATTEMPT   -> exit 0: go on; exit 3: do not run (reason logged);
                                                              exit 4: the run completed before: nothing to do
    python -m hpc_ddp.job.attempts end RUN_DIR ATTEMPT RC  -> prints "requeue", "requeued" (by Slurm), "next"
                                                              (the next job of the chain goes on), "stop", or
                                                              "restart COUNT NODES" (see below)
    python -m hpc_ddp.job.attempts resubmit RUN_DIR ATTEMPT WHY
        -> `scontrol requeue` failed (WHY): queue the next attempt as a new job that waits for this one

Chains (see `chain`): a run may go on in other Slurm jobs, queued up front by `submit --chain N` or by
`resubmit` where requeueing is impossible (a site that forbids it, no scontrol on the nodes). The policy
counts attempts per chain, so the caps hold across job ids. A later job of a chain ends at once (exit 4)
when the run completed in an earlier one, and does not run when the run stopped there (exit 3). A time
limit that hands over to the next job queued by --chain is what the chain is for: it counts against no cap.

Restarts inside the allocation (`decide_restart`): where the batch script says it can restart (it sets
HPC_DDP_RESTART_STEP, the number of the srun step that just ended), a rank that crashed on a healthy node
("failed", after it trained) or a node Slurm holds lost while enough nodes remain ("node_failure": a
range's MIN, or, for a fixed size, every node) is not requeued: `end` prints "restart COUNT NODES" and the
script starts a new srun step on those nodes (comma-separated), which resumes from the last checkpoint.
At most `max_restarts` per attempt; after that the usual rules decide (a crash stops the run, a lost node
is requeued). A restart is recorded as a "restarted" event, not an attempt_end: the attempt goes on.
With `--no-kill` Slurm keeps the allocation when a node fails, and removes the node from it (measured on
Slurm 22.05: the job's NodeList shrinks, srun ends with 137 and "Node failure on NODE"; a requeue after
that asks for the job's original node count again). Where the lost node is the batch host, Slurm 22.05
kills the batch script and leaves the job RUNNING on the other nodes with nothing in it: `hostguard`,
a small step on another node, requeues it then.

Everything is recorded in RUN_DIR/events.jsonl (append-only), next to the trainer's own records, so
`hpc-ddp status` can tell the whole story. The policy itself (`decide_begin`, `decide_end`) is pure.

Causes: an attempt ends "completed" (exit 0 with no stop before it, or a recorded finish), "time_limit" or
"preempted" (exit 75 after the program checkpointed; the trainer says which: a stop near the job's end time
is a time limit; or a stop from outside, whatever the exit code, 0 included: frameworks catch SIGTERM and
exit 0), "killed" (no end record: the job was killed from outside before the batch shell could say so,
and Slurm's accounting, which the next begin asks, does not say PREEMPTED, TIMEOUT or NODE_FAIL),
"cancelled", or "failed". An exit 0 after the time-limit warning reached a handler of the program's own
(exitsite/hpc_ddp_warned.py records it as a "warned" event) is a time limit too.

A program that dies of Slurm's SIGTERM (preemption, an admin's requeue, the hard time limit) is not a
failed program: `end` asks Slurm what happened to the job (`scontrol show job`) and records such an
attempt as "preempted" or "time_limit", so it runs again within the caps. What Slurm shows from inside
the batch shell, measured on Slurm 22.05 (tests/e2e/test_user_scripts.py runs each case):

    preempted, GraceTime=0      COMPLETING, Restarts already +1  -> Slurm requeues the job itself
    preempted, GraceTime>0      RUNNING, PreemptTime set         -> ends as FAILED unless we requeue it
    scontrol requeue (admin)    COMPLETING, Restarts already +1  -> Slurm requeues the job itself
    time limit                  COMPLETING or TIMEOUT, Reason=TimeLimit
    scancel                     COMPLETING or CANCELLED, nothing of the above -> cancelled: never requeued
    the program's own crash     RUNNING, nothing of the above    -> failed: never requeued

Without Slurm's answer (no scontrol), a SIGTERM the batch shell trapped stands for "signalled from
outside" (HPC_DDP_SHELL_SIGNAL), so a preemption still runs again.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.common.durable import read_regular
from hpc_ddp.common.errors import HpcDdpError, SubmitError, report
from hpc_ddp.common.events import JsonLines, read_jsonl
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE
from hpc_ddp.common.procs import CommandRunner, SubprocessCommands
from hpc_ddp.common.rundir import LATEST, SCRIPT, RunDir, checkpoint_step
from hpc_ddp.job.chain import chain_of, members, successor
from hpc_ddp.slurm.jobstate import accounting

__all__ = ["Admission", "Attempt", "Limits", "admit", "attempts_from_events", "current_job", "decide_begin",
           "decide_end", "decide_restart", "decide_successor", "latest_checkpoint_step", "outside_cause", "stopped_cause",
           "parse_show_job", "resubmit"]

NOT_ADMITTED_EXIT_CODE = 3
# A later job of a chain whose run already completed: nothing to do, and not a failure (the batch script
# exits 0, so a job waiting on it with afterok still starts).
RUN_COMPLETE_EXIT_CODE = 4
# An attempt of a user's own script (no trainer events) counts as having trained once it ran this long.
STARTUP_S = 60.0


@dataclasses.dataclass(frozen=True)
class Limits:
    max_requeues: int = 10        # requeues after time limits
    max_preemptions: int = 20     # requeues after preemptions (and outside kills)
    max_restarts: int = 0         # restarts inside the allocation per attempt (rank crash, lost node)


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


def latest_checkpoint_step(run_dir: Path) -> int | None:
    """The step `checkpoints/latest` names, without importing torch (the trainer verifies it on load)."""
    try:  # a FIFO or a link to /dev/zero in place of `latest` must not hang or flood this
        name = read_regular(RunDir(run_dir).checkpoints / LATEST, limit=64).decode().strip()
    except (OSError, ValueError):
        return None
    return checkpoint_step(name)


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
            a.trainer = a.checkpointed = a.finished = a.warned = False
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
_LOST_STATES = ("down", "fail", "failing", "not_responding", "unknown")


def lost_state(state: str) -> bool:
    """Is a node in sinfo's extended state `state` (down, down*, idle*, fail, mixed+drain, ...) lost?"""
    word = state.strip().lower()
    return word.endswith("*") or word.split("+")[0].rstrip("~#!%$@^-") in _LOST_STATES


# An attempt that left no end record (its batch shell was killed first) ended this way, where Slurm's accounting
# says so of the job's run (sacct -D); any other state, or no accounting, leaves it "killed".
ACCOUNTED_CAUSES = {"PREEMPTED": "preempted", "TIMEOUT": "time_limit", "NODE_FAIL": "node_failure"}
UNRECORDED_CAUSES = ("node_failure", "preempted", "time_limit")


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


def down_nodes(nodelist: str | None, run=subprocess.run) -> list[str]:
    """The nodes of `nodelist` (Slurm's hostlist) that Slurm holds lost now (`lost_state`), sorted; [] when
    none, or when Slurm cannot be asked."""
    if not nodelist or not shutil.which("sinfo"):
        return []
    try:
        done = run(["sinfo", "-h", "-N", "-n", nodelist, "-o", "%N|%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    lost = {name for name, _, state in (line.partition("|") for line in done.stdout.splitlines()) if lost_state(state)}
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


# ---- the edge: what the batch script and the local executor call ----

def _spec(run_dir: Path):
    from hpc_ddp.spec.jobspec import load_spec

    return load_spec(RunDir(run_dir).spec)


def _code_of(run_dir: Path) -> dict[str, str]:
    """{"code": the id of the snapshot the spec names}, or {} (none, or no spec to read)."""
    try:
        code = _spec(run_dir).code
    except HpcDdpError:
        return {}
    return {"code": code.id} if code is not None else {}


def _limits(spec) -> Limits:
    return Limits(spec.max_requeues, spec.max_preemptions, getattr(spec, "max_restarts", 0))


@dataclasses.dataclass(frozen=True)
class Admission:
    ok: bool               # run the attempt
    reason: str
    done: bool = False     # the run completed in an earlier job of its chain: nothing to do, not a failure

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else RUN_COMPLETE_EXIT_CODE if self.done else NOT_ADMITTED_EXIT_CODE


def begin(run_dir: Path, attempt: int, env: dict[str, str] | None = None) -> tuple[bool, str]:
    admission = admit(run_dir, attempt, env)
    return admission.ok, admission.reason


def admit(run_dir: Path, attempt: int, env: Mapping[str, str] | None = None) -> Admission:
    """Record the start of attempt `attempt` and decide whether it may run."""
    env = dict(os.environ if env is None else env)
    events = JsonLines(RunDir(run_dir).events)
    job_id = env.get("SLURM_JOB_ID") or env.get("HPC_DDP_JOB_ID")
    chain = chain_of(run_dir, job_id) if job_id else None
    previous = attempts_from_events(read_jsonl(RunDir(run_dir).events), chain)
    step = latest_checkpoint_step(run_dir)
    verdict = decide_successor(previous, _cancelled_in(run_dir, chain)) if chain != job_id else None
    if verdict and verdict[0] == "done":
        events.write({"event": "skipped", "job_id": job_id, "chain": chain, "reason": verdict[1]})
        return Admission(False, verdict[1], done=True)
    lost = down_nodes(previous[-1].step_nodes or previous[-1].nodes) \
        if previous and previous[-1].exit_code is None and env.get("SLURM_JOB_ID") else []
    if lost:  # the attempt before left no end record: its node went down, taking the batch shell with it
        previous[-1].cause = "node_failure"
    accounted = None
    if previous and previous[-1].exit_code is None and env.get("SLURM_JOB_ID") and not lost:
        # Slurm killed the batch shell before it could say why (a program that outlived GraceTime or KillWait,
        # as Lightning's SIGTERM handler can under DDP): Slurm's accounting still knows.
        accounted = accounted_end(previous[-1].job_id or job_id)
        if accounted in ACCOUNTED_CAUSES:
            previous[-1].cause = ACCOUNTED_CAUSES[accounted]
    ok, reason = (False, verdict[1]) if verdict else decide_begin(previous, step, _limits(_spec(run_dir)))
    # "code": the snapshot this attempt runs (the spec names it; a resubmission to the run dir names another)
    events.write({"event": "attempt_start", "attempt": attempt, "job_id": job_id,
                  **({"chain": chain} if chain != job_id else {}),
                  "nodes": env.get("SLURM_JOB_NODELIST"), "checkpoint_step": step,
                  **_code_of(run_dir)})
    if previous and previous[-1].exit_code is None:
        events.write({"event": "attempt_end", "attempt": previous[-1].number, "exit_code": None,
                      **({"cause": "node_failure", "nodes": ",".join(lost),
                          "note": f"no end record: node {', '.join(lost)} of the attempt went down (Slurm holds it down "
                                  "or not responding) and took the batch shell with it"} if lost else
                         {"cause": previous[-1].cause, "note": f"no end record: Slurm's accounting says {accounted}; "
                                                               "the batch shell was killed before it could record "
                                                               "the end (the program outlived GraceTime or KillWait)"}
                         if accounted in ACCOUNTED_CAUSES else
                         {"cause": "killed", "note": "no end record: the job was killed from outside (preempted, "
                                                     "requeued or node failure)"
                                                     + (f"; Slurm's accounting says {accounted}" if accounted else "")})})
    if not ok:
        events.write({"event": "attempt_end", "attempt": attempt, "exit_code": NOT_ADMITTED_EXIT_CODE,
                      "cause": "not_admitted"})
        events.write({"event": "gave_up", "attempt": attempt, "reason": reason})
    return Admission(ok, reason)


@dataclasses.dataclass(frozen=True)
class Outcome:
    requeue: bool           # run the job again
    reason: str
    by_slurm: bool = False  # Slurm has requeued it already (preemption with GraceTime=0, admin requeue)
    next_job: str | None = None  # the next job of the chain, already queued, goes on instead
    restart_on: tuple[str, ...] = ()  # restart inside the allocation, a new srun step on these nodes

    @property
    def word(self) -> str:
        """What the batch script reads: requeue (it must run `scontrol requeue`), requeued, next (the
        chain's next job goes on: nothing to do), stop, or `restart COUNT NODES` (a new srun step on NODES,
        comma-separated)."""
        if self.restart_on:
            return f"restart {len(self.restart_on)} {','.join(self.restart_on)}"
        if not self.requeue:
            return "stop"
        return "requeued" if self.by_slurm else "next" if self.next_job else "requeue"


def end(run_dir: Path, attempt: int, exit_code: int, env: dict[str, str] | None = None) -> tuple[bool, str]:
    outcome = finish(run_dir, attempt, exit_code, env)
    return outcome.requeue, outcome.reason


def finish(run_dir: Path, attempt: int, exit_code: int, env: Mapping[str, str] | None = None,
           ask_slurm=slurm_job) -> Outcome:
    """Record how attempt `attempt` ended and decide whether the job runs again.
    `env` may carry HPC_DDP_SHELL_SIGNAL: a signal the batch shell (or local executor) received."""
    env = dict(os.environ if env is None else env)
    events = JsonLines(RunDir(run_dir).events)
    job_id = env.get("SLURM_JOB_ID") or env.get("HPC_DDP_JOB_ID")
    attempts = attempts_from_events(read_jsonl(RunDir(run_dir).events), chain_of(run_dir, job_id) if job_id else None)
    if not attempts:
        attempts = [Attempt(attempt, None)]
    last = attempts[-1]
    if last.checkpointed and exit_code != 0:
        # The program's record wins over srun's exit code: with --kill-on-bad-exit, the ranks that were
        # still exiting after the checkpoint (code 75 counts as "bad") are killed, and srun reports 143.
        exit_code = REQUEUE_EXIT_CODE
    # A run that recorded its finish (the trainer, a Session) completed, whatever came after; any other
    # ending is judged by what happened to the job, exit 0 included (see stopped_cause).
    done = exit_code == 0 and last.finished
    slurm = ask_slurm(env.get("SLURM_JOB_ID")) if not done and env.get("SLURM_JOB_ID") else None
    by_slurm = False
    shell_signal = env.get("HPC_DDP_SHELL_SIGNAL") or None
    if exit_code == REQUEUE_EXIT_CODE:
        last.cause = last.cause or _cause_from_deadline(env)
        by_slurm = bool(slurm) and _int(slurm.get("Restarts")) > attempt
        if slurm and not by_slurm and outside_cause(slurm, attempt, shell_signal)[0] == "cancelled":
            # scancel: the program checkpointed at its SIGTERM as at a preemption, but the job was cancelled
            # (a requeue would fail on it, and the fallback would queue a new job the user never wanted)
            last.cause = "cancelled"
    elif exit_code == 0:
        last.cause, by_slurm = ("completed", False) if done else stopped_cause(slurm, attempt, shell_signal)
        if last.cause == "completed" and last.warned and not done:
            # the program's own handler got the time-limit warning and it left with exit 0: it stopped early
            last.cause = "time_limit"
    else:
        last.cause, by_slurm = outside_cause(slurm, attempt, shell_signal)
    if slurm is None and shell_signal and last.cause == "preempted":
        # No Slurm to ask (the local and srun executors, no scontrol): a stop at the deadline is its limit.
        last.cause = _cause_from_deadline(env)
    step_nodes = last.step_nodes or env.get("SLURM_JOB_NODELIST")
    lost = down_nodes(step_nodes) if exit_code != 0 and last.cause in ("failed", "preempted") \
        and env.get("SLURM_JOB_ID") else []
    if lost:  # a node of the job went down: its ranks vanished, whatever the others' exit codes say
        last.cause = "node_failure"
    last.exit_code, last.ended_at = exit_code, time.time()
    if env.get("HPC_DDP_RESTART_STEP") and exit_code not in (0, REQUEUE_EXIT_CODE) and not by_slurm:
        restart = _restart_in_place(run_dir, attempt, exit_code, last, lost, slurm, env)
        if restart is not None:
            return restart
    goes_on = exit_code == REQUEUE_EXIT_CODE or last.cause in ("preempted", "time_limit", "node_failure")
    next_job = _waiting_successor(run_dir, env.get("SLURM_JOB_ID"), ask_slurm) if goes_on and not by_slurm else None
    requeue, reason = decide_end(attempts, exit_code, _limits(_spec(run_dir)), next_job)
    record = {"event": "attempt_end", "attempt": attempt, "exit_code": exit_code, "cause": last.cause}
    if lost:
        record.update(nodes=",".join(lost), note=f"node {', '.join(lost)} went down (Slurm holds it down or not "
                                                 "responding); the next attempt runs on nodes that are up")
    elif exit_code not in (0, REQUEUE_EXIT_CODE) and last.cause != "failed":
        record["note"] = f"signalled from outside ({_outside_note(slurm, env)}), not the program's failure"
    elif exit_code == 0 and last.cause != "completed":
        seen = "the time-limit warning reached its handler" if last.warned and not slurm_stop(slurm, attempt) \
            else _outside_note(slurm, env)
        record["note"] = f"exit code 0 after a stop reached the program ({seen}): interrupted, not completed"
    events.write(record)
    if goes_on:
        how = {"by": "slurm"} if by_slurm else {"by": "chain", "next_job": next_job} if next_job else {}
        events.write({"event": "requeue" if requeue else "gave_up", "attempt": attempt, "reason": reason,
                      **(how if requeue else {})})
    elif last.cause == "cancelled":  # as the local executor records a cancel: status says CANCELLED
        events.write({"event": "gave_up", "attempt": attempt, "reason": "cancelled (scancel)", "cause": "cancelled"})
    return Outcome(requeue, reason, by_slurm, next_job if requeue else None)


def _restart_in_place(run_dir: Path, attempt: int, exit_code: int, last: Attempt, lost: list[str],
                      slurm: Mapping[str, str] | None, env: Mapping[str, str]) -> Outcome | None:
    """The attempt's step ended with a crash or a lost node: an Outcome restarting it in the allocation
    (recorded as a "restarted" event), or None where `decide_restart` says no (the usual rules go on)."""
    spec = _spec(run_dir)
    from hpc_ddp.slurm.nodelist import expand_hostlist

    try:  # the allocation as Slurm holds it now (with --no-kill a lost node has left it), less what is lost
        allocation = expand_hostlist((slurm or {}).get("NodeList") or last.step_nodes or env.get("SLURM_JOB_NODELIST")
                                     or "")
    except (ValueError, HpcDdpError):
        allocation = ()
    healthy = [n for n in allocation if n not in lost and n not in down_nodes(",".join(allocation))] \
        if allocation else []
    step = latest_checkpoint_step(run_dir)
    ok, reason = decide_restart(last, _limits(spec), healthy=healthy, min_nodes=spec.nodes, checkpoint_step=step)
    if not ok:
        if last.restarts or last.cause == "node_failure" or _limits(spec).max_restarts:
            print(f"hpc-ddp: not restarted in the allocation: {reason}", file=sys.stderr, flush=True)
        return None
    events = JsonLines(RunDir(run_dir).events)
    now = time.time()
    since = _last_progress(read_jsonl(RunDir(run_dir).events), last)
    events.write({"event": "restarted", "attempt": attempt, "restart": last.restarts + 1,
                  "cause": last.cause, "exit_code": exit_code,
                  "nodes": ",".join(healthy), "node_count": len(healthy),
                  **({"lost_nodes": ",".join(lost)} if lost else {}),
                  "checkpoint_step": step, "seconds_lost": round(max(now - since, 0.0), 3) if since else None,
                  "reason": reason})
    return Outcome(False, reason, restart_on=tuple(healthy))


def _last_progress(events: Sequence[dict[str, Any]], last: Attempt) -> float | None:
    """When the step that just ended last saved (its newest checkpoint record), else when it began: the
    work after that is lost, and the restart redoes it."""
    began = last.step_started_at if last.step_started_at is not None else last.started_at
    if began is None:
        return None
    saved = [e.get("time") for e in events if e.get("event") == "checkpoint"
             and isinstance(e.get("time"), (int, float)) and e["time"] >= began]
    return max(saved) if saved else began


def finished_in_last_attempt(run_dir: Path) -> bool:
    """The newest attempt recorded the run's finish (the trainer, a Session): it completed, even where a
    cancel or a stop came after."""
    attempts = attempts_from_events(read_jsonl(RunDir(run_dir).events))
    return bool(attempts) and attempts[-1].finished


def _cancelled_in(run_dir: Path, chain: str | None) -> str | None:
    """A job of the chain that `hpc-ddp cancel` cancelled (it records that), even one cancelled before it
    ever started: the jobs queued after it must not take the run up again."""
    if chain is None:
        return None
    jobs = members(run_dir, chain)
    cancelled = [str(e.get("job_id")) for e in read_jsonl(RunDir(run_dir).events)
                 if e.get("event") == "cancelled" and str(e.get("job_id")) in jobs]
    return cancelled[-1] if cancelled else None


def _waiting_successor(run_dir: Path, job_id: str | None, ask_slurm) -> str | None:
    """The next job of this job's chain, if one is queued and still waits: the run goes on there rather
    than by a requeue (which would queue this job again, behind it). One Slurm shows in another state
    (cancelled) does not count. Where Slurm gives no answer (no scontrol here) the record is trusted:
    queueing a fallback job beside a successor that does wait would start two jobs on one run dir."""
    following = successor(run_dir, job_id) if job_id else None
    if following is None:
        return None
    job = ask_slurm(following)
    return following if job is None or job.get("JobState") == "PENDING" else None


def resubmit(run_dir: Path, attempt: int, why: str, env: Mapping[str, str] | None = None, queue=None) -> str:
    """`scontrol requeue` failed (`why`: what it said): queue the next attempt as a new job that waits for
    this one (`job.chain.queue_next`), on the same run dir and chain, so the same policy
    and caps apply. Returns the new job id; raises SubmitError (and records gave_up) when that fails too."""
    env = dict(os.environ if env is None else env)
    events = JsonLines(RunDir(run_dir).events)
    job_id = env.get("SLURM_JOB_ID")
    if queue is None:
        from hpc_ddp.job.chain import queue_next as queue
    why = " ".join(why.split())[:300] or "no reason given"
    try:
        if not job_id:
            raise SubmitError("SLURM_JOB_ID is not set: not inside a Slurm job")
        next_job = queue(run_dir, job_id, chain_of(run_dir, job_id), env)
    except HpcDdpError as exc:
        reason = f"scontrol requeue failed ({why}), and queueing the next attempt as a new job failed too: {exc.message}"
        events.write({"event": "gave_up", "attempt": attempt, "reason": reason})
        raise SubmitError(reason, hint=f"go on by hand: cd {shlex.quote(str(run_dir))} && sbatch {SCRIPT}") from None
    events.write({"event": "requeue_fallback", "attempt": attempt, "job_id": job_id, "next_job": next_job,
                  "why": why})
    return next_job


def _outside_note(slurm: Mapping[str, str] | None, env: Mapping[str, str]) -> str:
    if not slurm:
        return f"SIG{env.get('HPC_DDP_SHELL_SIGNAL')} to the batch shell"
    return ", ".join(f"{k}={slurm[k]}" for k in ("JobState", "Reason", "Restarts", "PreemptTime") if k in slurm)


def _cause_from_deadline(env: dict[str, str]) -> str:
    """For programs that exit 75 without saying why (user scripts): near the job's end time, a time limit."""
    from hpc_ddp.job.deadline import job_deadline

    deadline = job_deadline(env)
    return "time_limit" if deadline is not None and deadline - time.time() <= 300 else "preempted"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["begin"] and len(args) == 3:
            admission = admit(Path(args[1]), int(args[2]))
            print(f"hpc-ddp: attempt {args[2]}: {admission.reason}", flush=True)
            return admission.exit_code
        if args[:1] == ["end"] and len(args) == 4:
            outcome = finish(Path(args[1]), int(args[2]), int(args[3]))
            print(outcome.word, flush=True)
            print(f"hpc-ddp: attempt {args[2]} ended: {outcome.reason}", file=sys.stderr, flush=True)
            return 0
        if args[:1] == ["resubmit"] and len(args) == 4:
            next_job = resubmit(Path(args[1]), int(args[2]), args[3])
            print(f"hpc-ddp: the next attempt is job {next_job}, queued to start when this one ends", flush=True)
            return 0
    except Exception as exc:  # noqa: BLE001 - the batch log gets one line (a traceback for a bug)
        return report(exc, "hpc-ddp attempts", traceback_for_bugs=True)
    print("usage: python -m hpc_ddp.job.attempts begin RUN_DIR ATTEMPT | end RUN_DIR ATTEMPT EXIT_CODE | "
          "resubmit RUN_DIR ATTEMPT WHY", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
