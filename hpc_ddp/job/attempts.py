"""The requeue policy: what each attempt of a job was, why it ended, and whether to run another.

The batch script (and the local executor) call this at the start and the end of every attempt:

    python -m hpc_ddp.job.attempts begin RUN_DIR ATTEMPT   -> exit 0: go on; exit 3: do not run (reason logged)
    python -m hpc_ddp.job.attempts end RUN_DIR ATTEMPT RC  -> prints "requeue", "requeued" (by Slurm) or "stop"

Everything is recorded in RUN_DIR/events.jsonl (append-only), next to the trainer's own records, so
`hpc-ddp status` can tell the whole story. The policy itself (`decide_begin`, `decide_end`) is pure.

Causes: an attempt ends "completed" (exit 0), "time_limit" or "preempted" (exit 75 after the program
checkpointed; the trainer says which: a stop near the job's end time is a time limit), "killed" (no end
record: the job was killed from outside before the batch shell could say so), "cancelled", or "failed".

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
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.common.durable import read_regular
from hpc_ddp.common.errors import report
from hpc_ddp.common.events import JsonLines, read_jsonl
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE
from hpc_ddp.common.rundir import LATEST, RunDir, checkpoint_step

__all__ = ["Attempt", "Limits", "attempts_from_events", "decide_begin", "decide_end", "latest_checkpoint_step",
           "outside_cause", "parse_show_job"]

NOT_ADMITTED_EXIT_CODE = 3
# An attempt of a user's own script (no trainer events) counts as having trained once it ran this long.
STARTUP_S = 60.0


@dataclasses.dataclass(frozen=True)
class Limits:
    max_requeues: int = 10        # requeues after time limits
    max_preemptions: int = 20     # requeues after preemptions (and outside kills)


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
        if self.exit_code is None:
            return "killed"
        return self.cause or ("completed" if self.exit_code == 0 else "failed")


def latest_checkpoint_step(run_dir: Path) -> int | None:
    """The step `checkpoints/latest` names, without importing torch (the trainer verifies it on load)."""
    try:  # a FIFO or a link to /dev/zero in place of `latest` must not hang or flood this
        name = read_regular(RunDir(run_dir).checkpoints / LATEST, limit=64).decode().strip()
    except (OSError, ValueError):
        return None
    return checkpoint_step(name)


def attempts_from_events(events: Sequence[dict[str, Any]], job_id: str | None = None) -> list[Attempt]:
    """The attempts recorded in `events`; with `job_id`, only that job's (a new submission of the same
    run dir is a new job: an earlier job's failures do not stop it)."""
    attempts: list[Attempt] = []
    for event in _of_job(events, job_id):
        kind = event.get("event")
        if kind == "attempt_start":
            if attempts and attempts[-1].ended_at is None:
                attempts[-1].ended_at = event.get("time")  # killed: it ended before this one began
            attempts.append(Attempt(int(event.get("attempt", len(attempts))), event.get("checkpoint_step"),
                                    started_at=event.get("time")))
        elif not attempts:
            continue
        elif kind in ("start", "resume"):
            attempts[-1].trainer = True
        elif kind == "signal":
            attempts[-1].cause = event.get("cause")
        elif kind == "requeue_requested":
            attempts[-1].checkpointed = True
        elif kind == "attempt_end" and attempts[-1].exit_code is None:
            attempts[-1].exit_code = event.get("exit_code")
            attempts[-1].cause = event.get("cause") or attempts[-1].cause
            attempts[-1].ended_at = event.get("time") or attempts[-1].ended_at
    return attempts


def _of_job(events: Sequence[dict[str, Any]], job_id: str | None) -> list[dict[str, Any]]:
    if job_id is None:
        return list(events)
    starts = [i for i, e in enumerate(events) if e.get("event") == "attempt_start" and str(e.get("job_id")) == job_id]
    return list(events[starts[0]:]) if starts else []


def _count(attempts: Sequence[Attempt], *causes: str) -> int:
    return sum(1 for a in attempts if a.ended_cause in causes)


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
    timeouts = _count(previous, "time_limit")
    if timeouts > limits.max_requeues:
        return False, f"hit the time limit {timeouts} times, more than max_requeues={limits.max_requeues}"
    return True, f"restart {len(previous)} after {last.ended_cause}"


def decide_end(attempts: Sequence[Attempt], exit_code: int, limits: Limits) -> tuple[bool, str]:
    """Should the job be requeued after this attempt (the last of `attempts`)? (requeue, reason).
    An exit code other than 0 and 75 is requeued only when the attempt's cause says it came from
    outside (preempted, time_limit: see `outside_cause`)."""
    cause = attempts[-1].cause
    if exit_code == 0:
        return False, "completed"
    if cause == "cancelled":
        return False, "cancelled"
    if exit_code != REQUEUE_EXIT_CODE and cause not in ("preempted", "time_limit"):
        return False, f"failed with exit code {exit_code}"
    if exit_code == REQUEUE_EXIT_CODE and not attempts[-1].trained:
        return False, "it asked to be requeued before training started (crash loop guard)"
    cause = cause or "preempted"
    if cause == "time_limit":
        used, cap, name = _count(attempts, "time_limit"), limits.max_requeues, "max_requeues"
    else:
        used, cap, name = _count(attempts, "preempted", "killed"), limits.max_preemptions, "max_preemptions"
    if used > cap:
        return False, f"{cause}: {used} requeues would exceed {name}={cap}"
    return True, f"{cause}: requeue {used} of at most {cap}"


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

def _limits(run_dir: Path) -> Limits:
    from hpc_ddp.spec.jobspec import load_spec

    spec = load_spec(RunDir(run_dir).spec)
    return Limits(spec.max_requeues, spec.max_preemptions)


def begin(run_dir: Path, attempt: int, env: dict[str, str] | None = None) -> tuple[bool, str]:
    env = dict(os.environ if env is None else env)
    events = JsonLines(RunDir(run_dir).events)
    job_id = env.get("SLURM_JOB_ID") or env.get("HPC_DDP_JOB_ID")
    previous = attempts_from_events(read_jsonl(RunDir(run_dir).events), job_id)
    step = latest_checkpoint_step(run_dir)
    ok, reason = decide_begin(previous, step, _limits(run_dir))
    events.write({"event": "attempt_start", "attempt": attempt, "job_id": job_id,
                  "nodes": env.get("SLURM_JOB_NODELIST"), "checkpoint_step": step})
    if previous and previous[-1].exit_code is None:
        events.write({"event": "attempt_end", "attempt": previous[-1].number, "exit_code": None, "cause": "killed",
                      "note": "no end record: the job was killed from outside (preempted, requeued or node failure)"})
    if not ok:
        events.write({"event": "attempt_end", "attempt": attempt, "exit_code": NOT_ADMITTED_EXIT_CODE,
                      "cause": "not_admitted"})
        events.write({"event": "gave_up", "attempt": attempt, "reason": reason})
    return ok, reason


@dataclasses.dataclass(frozen=True)
class Outcome:
    requeue: bool           # run the job again
    reason: str
    by_slurm: bool = False  # Slurm has requeued it already (preemption with GraceTime=0, admin requeue)

    @property
    def word(self) -> str:
        """What the batch script reads: requeue (it must run `scontrol requeue`), requeued, or stop."""
        return ("requeued" if self.by_slurm else "requeue") if self.requeue else "stop"


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
    attempts = attempts_from_events(read_jsonl(RunDir(run_dir).events), job_id)
    if not attempts:
        attempts = [Attempt(attempt, None)]
    last = attempts[-1]
    if last.checkpointed and exit_code != 0:
        # The program's record wins over srun's exit code: with --kill-on-bad-exit, the ranks that were
        # still exiting after the checkpoint (code 75 counts as "bad") are killed, and srun reports 143.
        exit_code = REQUEUE_EXIT_CODE
    slurm = ask_slurm(env.get("SLURM_JOB_ID")) if exit_code != 0 and env.get("SLURM_JOB_ID") else None
    by_slurm = False
    if exit_code == REQUEUE_EXIT_CODE:
        last.cause = last.cause or _cause_from_deadline(env)
        by_slurm = bool(slurm) and _int(slurm.get("Restarts")) > attempt
    elif exit_code == 0:
        last.cause = "completed"
    else:
        last.cause, by_slurm = outside_cause(slurm, attempt, env.get("HPC_DDP_SHELL_SIGNAL") or None)
    last.exit_code, last.ended_at = exit_code, time.time()
    requeue, reason = decide_end(attempts, exit_code, _limits(run_dir))
    record = {"event": "attempt_end", "attempt": attempt, "exit_code": exit_code, "cause": last.cause}
    if exit_code not in (0, REQUEUE_EXIT_CODE) and last.cause != "failed":
        record["note"] = f"signalled from outside ({_outside_note(slurm, env)}), not the program's failure"
    events.write(record)
    if exit_code == REQUEUE_EXIT_CODE or last.cause in ("preempted", "time_limit"):
        events.write({"event": "requeue" if requeue else "gave_up", "attempt": attempt, "reason": reason,
                      **({"by": "slurm"} if requeue and by_slurm else {})})
    elif last.cause == "cancelled":  # as the local executor records a cancel: status says CANCELLED
        events.write({"event": "gave_up", "attempt": attempt, "reason": "cancelled (scancel)", "cause": "cancelled"})
    return Outcome(requeue, reason, by_slurm)


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
            ok, reason = begin(Path(args[1]), int(args[2]))
            print(f"hpc-ddp: attempt {args[2]}: {reason}", flush=True)
            return 0 if ok else NOT_ADMITTED_EXIT_CODE
        if args[:1] == ["end"] and len(args) == 4:
            outcome = finish(Path(args[1]), int(args[2]), int(args[3]))
            print(outcome.word, flush=True)
            print(f"hpc-ddp: attempt {args[2]} ended: {outcome.reason}", file=sys.stderr, flush=True)
            return 0
    except Exception as exc:  # noqa: BLE001 - the batch log gets one line (a traceback for a bug)
        return report(exc, "hpc-ddp attempts", traceback_for_bugs=True)
    print("usage: python -m hpc_ddp.job.attempts begin RUN_DIR ATTEMPT | end RUN_DIR ATTEMPT EXIT_CODE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
