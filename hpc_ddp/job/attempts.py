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
`hpc-ddp status` can tell the whole story. The policy itself (`job.policy`: `decide_begin`, `decide_end`,
`decide_restart`) is pure; what Slurm's answers mean, and what each Slurm version does, is `slurm.jobview`;
the restarts inside the allocation, `job.restarts`. This module is the edge that reads, asks and records.

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
    preempted, GraceTime>0      RUNNING, PreemptTime set         -> 22.05-23.11: ends unless we requeue it;
                                                                    24.05 on: Slurm requeues it at its end
    scontrol requeue (admin)    COMPLETING, Restarts already +1  -> Slurm requeues the job itself
    time limit                  COMPLETING or TIMEOUT, Reason=TimeLimit
    scancel                     COMPLETING or CANCELLED, nothing of the above -> cancelled: never requeued
    the program's own crash     RUNNING, nothing of the above    -> failed: never requeued

Without Slurm's answer (no scontrol), a SIGTERM the batch shell trapped stands for "signalled from
outside" (HPC_DDP_SHELL_SIGNAL), so a preemption still runs again.

A run that completed is never run again, whoever starts its job once more: the next begin records it as
"skipped" and the batch script exits 0 (Slurm 24.05 to 25.11 requeue a job once more after it completed,
where hpc-ddp's own requeue met a preemption's GraceTime: `slurm.jobview`), so the job ends COMPLETED.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from hpc_ddp.common.durable import read_regular
from hpc_ddp.common.errors import HpcDdpError, SubmitError, report
from hpc_ddp.common.events import JsonLines, read_jsonl
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE
from hpc_ddp.common.rundir import LATEST, SCRIPT, RunDir, checkpoint_step
from hpc_ddp.job.chain import chain_of, members, successor
# The policy's and Slurm's names, re-exported: this module is what the batch script, the executors and
# `status` have always imported them from.
from hpc_ddp.job.policy import (REHEARSED, STARTUP_S, UNRECORDED_CAUSES, Attempt, Limits,  # noqa: F401
                                attempts_from_events, current_job, decide_begin, decide_end, decide_restart,
                                decide_successor, limits_of)
from hpc_ddp.job.restarts import restart_in_place
from hpc_ddp.slurm.jobview import (ACCOUNTED_CAUSES, _int, accounted_end, down_nodes, grace_preempted,  # noqa: F401
                                   lost_state, outside_cause, parse_show_job, preempt_mode, requeues_after_grace, slurm_job,
                                   slurm_stop, slurm_version, stopped_cause)

__all__ = ["Admission", "Attempt", "Limits", "admit", "attempts_from_events", "current_job", "decide_begin",
           "decide_end", "decide_restart", "decide_successor", "latest_checkpoint_step", "outside_cause", "stopped_cause",
           "parse_show_job", "resubmit"]

NOT_ADMITTED_EXIT_CODE = 3
# A later job of a chain whose run already completed: nothing to do, and not a failure (the batch script
# exits 0, so a job waiting on it with afterok still starts).
RUN_COMPLETE_EXIT_CODE = 4


def record_rehearsal(run_dir: Path, signal_name: str) -> None:
    """Before `hpc-ddp preempt` sends SIGTERM to ranks that are not here (a Slurm job): the record the end
    of the attempt reads (`policy.REHEARSED`), since Slurm shows nothing of a rehearsal."""
    JsonLines(RunDir(run_dir).events).write({"event": REHEARSED, "signal": signal_name})


def latest_checkpoint_step(run_dir: Path) -> int | None:
    """The step `checkpoints/latest` names, without importing torch (the trainer verifies it on load)."""
    try:  # a FIFO or a link to /dev/zero in place of `latest` must not hang or flood this
        name = read_regular(RunDir(run_dir).checkpoints / LATEST, limit=64).decode().strip()
    except (OSError, ValueError):
        return None
    return checkpoint_step(name)



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
    return limits_of(spec)


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
    if not verdict and previous and previous[-1].exit_code is not None and previous[-1].ended_cause == "completed":
        # The run completed, and Slurm started its job once more all the same (Slurm 24.05 to 25.11 do, after
        # a preemption with a GraceTime that hpc-ddp requeued: slurm.jobview; an admin's requeue may too).
        # Nothing to do, and no failure: the job ends COMPLETED, and this start is no attempt.
        reason = (f"the run completed in attempt {previous[-1].number}; Slurm started job {job_id} once more: "
                  "nothing to do")
        events.write({"event": "skipped", "attempt": attempt, "job_id": job_id, "reason": reason})
        return Admission(False, reason, done=True)
    # Why the attempt before died without an end record: here a node not responding is evidence enough.
    lost = down_nodes(previous[-1].step_nodes or previous[-1].nodes, silent=True) \
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
    at_end: bool = False    # by_slurm, once the batch script ends (a GraceTime preemption, Slurm 24.05 on)

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
           ask_slurm=None, grace_requeue=None) -> Outcome:
    """Record how attempt `attempt` ended and decide whether the job runs again.
    `env` may carry HPC_DDP_SHELL_SIGNAL: a signal the batch shell (or local executor) received.
    `ask_slurm(job_id)`: Slurm's view of the job (`slurm_job`); `grace_requeue(job, attempt, env)`: does Slurm
    requeue this job itself once the batch script ends (`slurm_requeues_after_grace`). Both looked up when
    called, not when this was defined, so a test that replaces them here asks no real Slurm."""
    ask_slurm = ask_slurm or slurm_job
    grace_requeue = grace_requeue or slurm_requeues_after_grace
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
    by_slurm = at_end = False
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
    if last.rehearsed and not done and last.cause in ("completed", "failed") and exit_code != REQUEUE_EXIT_CODE:
        # `hpc-ddp preempt --signal TERM` reached the ranks, and Slurm knows nothing of it: the program left
        # at that SIGTERM (Lightning exits 0, a plain script dies of it) as it would at a preemption
        last.cause = "preempted"
    if slurm is None and shell_signal and last.cause == "preempted":
        # No Slurm to ask (the local and srun executors, no scontrol): a stop at the deadline is its limit.
        last.cause = _cause_from_deadline(env)
    if last.cause == "preempted" and not by_slurm and grace_requeue(slurm, attempt, env):
        by_slurm = at_end = True  # preempted in its GraceTime, on a Slurm that requeues such a job itself at its end
    step_nodes = last.step_nodes or env.get("SLURM_JOB_NODELIST")
    lost = down_nodes(step_nodes) if exit_code != 0 and last.cause in ("failed", "preempted") \
        and env.get("SLURM_JOB_ID") else []
    if lost:  # a node of the job went down: its ranks vanished, whatever the others' exit codes say
        last.cause = "node_failure"
    last.exit_code, last.ended_at = exit_code, time.time()
    if env.get("HPC_DDP_RESTART_STEP") and exit_code not in (0, REQUEUE_EXIT_CODE) and not by_slurm:
        restart = restart_in_place(run_dir, attempt, exit_code, last, lost, slurm, env, _spec(run_dir),
                                   lost_now=down_nodes, checkpoint_step=latest_checkpoint_step(run_dir))
        if restart is not None:
            return Outcome(False, restart[1], restart_on=restart[0])
    goes_on = exit_code == REQUEUE_EXIT_CODE or last.cause in ("preempted", "time_limit", "node_failure")
    next_job = _waiting_successor(run_dir, env.get("SLURM_JOB_ID"), ask_slurm) if goes_on and not by_slurm else None
    requeue, reason = decide_end(attempts, exit_code, _limits(_spec(run_dir)), next_job)
    record = {"event": "attempt_end", "attempt": attempt, "exit_code": exit_code, "cause": last.cause}
    if lost:
        record.update(nodes=",".join(lost), note=f"node {', '.join(lost)} went down (Slurm holds it down or "
                                                 "failed); the next attempt runs on nodes that are up")
    elif exit_code not in (0, REQUEUE_EXIT_CODE) and last.cause != "failed":
        outside = REHEARSAL if last.rehearsed and not slurm_stop(slurm, attempt) else _outside_note(slurm, env)
        record["note"] = f"signalled from outside ({outside}), not the program's failure"
    elif exit_code == 0 and last.cause != "completed":
        seen = "the time-limit warning reached its handler" if last.warned and not slurm_stop(slurm, attempt) \
            else REHEARSAL if last.rehearsed and not slurm_stop(slurm, attempt) else _outside_note(slurm, env)
        record["note"] = f"exit code 0 after a stop reached the program ({seen}): interrupted, not completed"
    events.write(record)
    if goes_on:
        how = {"by": "slurm"} if by_slurm else {"by": "chain", "next_job": next_job} if next_job else {}
        events.write({"event": "requeue" if requeue else "gave_up", "attempt": attempt, "reason": reason,
                      **(how if requeue else {})})
    elif last.cause == "cancelled":  # as the local executor records a cancel: status says CANCELLED
        events.write({"event": "gave_up", "attempt": attempt, "reason": "cancelled (scancel)", "cause": "cancelled"})
    return Outcome(requeue, reason, by_slurm, next_job if requeue else None, at_end=by_slurm and at_end)


def slurm_requeues_after_grace(job: Mapping[str, str] | None, attempt: int, env: Mapping[str, str]) -> bool:
    """Will Slurm requeue the job itself when the batch script ends (`slurm.jobview.requeues_after_grace`)?
    Asks Slurm's version and the partition's PreemptMode only for a job preempted in its GraceTime."""
    if not grace_preempted(job, attempt):
        return False
    return requeues_after_grace(job, attempt, slurm_version(), preempt_mode((job or {}).get("Partition")
                                                                            or env.get("SLURM_JOB_PARTITION")))


def admission_of(run_dir: Path, attempt: int, job_id: str | None, timeout: float = 120.0,
                 poll: float = 0.2) -> Admission | None:
    """What rank 0's `admit` decided for `attempt` of job `job_id`, for the other ranks of a launch that runs
    it on rank 0 only (the submitit executor): an Admission once its record is there ("attempt_start"
    followed by no refusal, "skipped", or a refusal's "gave_up"), or None when none came within `timeout`
    seconds (the rank then goes on, as before). Reads only: rank 0 writes the records."""
    deadline = time.monotonic() + timeout
    seen_start = None  # rank 0 writes a refusal right after the start record: look again a moment later
    while True:
        started = False
        for event in read_jsonl(RunDir(run_dir).events):
            # a chain's "skipped" record names its job, not an attempt
            if event.get("attempt", attempt) != attempt or (event.get("job_id") not in (None, job_id)):
                continue
            kind = event.get("event")
            if kind == "skipped":
                return Admission(False, str(event.get("reason") or "skipped"), done=True)
            if kind == "attempt_start":
                started = True
            elif started and kind == "gave_up":
                return Admission(False, str(event.get("reason") or "not admitted"))
        now = time.monotonic()
        if started:
            seen_start = seen_start or now
            if now - seen_start >= 0.5:
                return Admission(True, "admitted")
        if now >= deadline:
            return None
        time.sleep(poll)


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


def resubmit(run_dir: Path, attempt: int, why: str, env: Mapping[str, str] | None = None, queue=None,
             ask_slurm=None) -> str | None:
    """`scontrol requeue` failed (`why`: what it said): queue the next attempt as a new job that waits for
    this one (`job.chain.queue_next`), on the same run dir and chain, so the same policy
    and caps apply. Returns the new job id; raises SubmitError (and records gave_up) when that fails too.
    None where Slurm shows the job requeued after all: the requeue's own SIGTERM to the batch shell can
    kill the `scontrol requeue` that caused it before it says so (seen on 22.05: "failed: no message"), and
    a fallback job then would run the run twice."""
    env = dict(os.environ if env is None else env)
    events = JsonLines(RunDir(run_dir).events)
    job_id = env.get("SLURM_JOB_ID")
    job = (ask_slurm or slurm_job)(job_id) if job_id else None
    if job and _int(job.get("Restarts")) > attempt:
        return None
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


REHEARSAL = "hpc-ddp preempt --signal TERM, a rehearsed preemption"


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
    numbers = args[2:4] if args[:1] == ["end"] else args[2:3]
    if len(args) >= 3 and not all(n.isascii() and n.lstrip("-").isdigit() and len(n) < 10 for n in numbers):
        # the batch script passes $SLURM_RESTART_COUNT and srun's exit code: anything else is damage
        print(f"hpc-ddp attempts: error: {' and '.join(repr(n) for n in numbers)} must be whole numbers "
              "(the attempt, and for end the exit code) HINT: run the batch script hpc-ddp wrote, as it is",
              file=sys.stderr, flush=True)
        return 2
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
            print(f"hpc-ddp: the next attempt is job {next_job}, queued to start when this one ends" if next_job
                  else "hpc-ddp: Slurm shows the job requeued after all: no job queued instead", flush=True)
            return 0
    except Exception as exc:  # noqa: BLE001 - the batch log gets one line (a traceback for a bug)
        return report(exc, "hpc-ddp attempts", traceback_for_bugs=True)
    print("usage: python -m hpc_ddp.job.attempts begin RUN_DIR ATTEMPT | end RUN_DIR ATTEMPT EXIT_CODE | "
          "resubmit RUN_DIR ATTEMPT WHY", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
