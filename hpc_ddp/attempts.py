"""The requeue policy: what each attempt of a job was, why it ended, and whether to run another.

The batch script (and the local executor) call this at the start and the end of every attempt:

    python -m hpc_ddp.attempts begin RUN_DIR ATTEMPT   -> exit 0: go on; exit 3: do not run (reason logged)
    python -m hpc_ddp.attempts end RUN_DIR ATTEMPT RC  -> prints "requeue" or "stop"

Everything is recorded in RUN_DIR/events.jsonl (append-only), next to the trainer's own records, so
`hpc-ddp status` can tell the whole story. The policy itself (`decide_begin`, `decide_end`) is pure.

Causes: an attempt ends "completed" (exit 0), "time_limit" or "preempted" (exit 75 after the trainer
checkpointed; the trainer says which: a stop near the job's end time is a time limit), "killed"
(no end record: the job was killed from outside, e.g. preempted or requeued by an admin), or "failed".
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .events import JsonLines, read_jsonl
from .exitcodes import REQUEUE_EXIT_CODE

__all__ = ["Attempt", "Limits", "attempts_from_events", "decide_begin", "decide_end", "latest_checkpoint_step"]

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
    try:
        name = (run_dir / "checkpoints" / "latest").read_text().strip()
    except (OSError, ValueError):
        return None
    m = re.match(r"^step-(\d+)(?:-r\d+)?$", name)
    return int(m.group(1)) if m else None


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
    # An attempt killed from outside (node failure, hard preemption, admin requeue) is not the job's
    # fault: it only counts against max_preemptions. The guards below judge attempts that ended by
    # themselves.
    if last.exit_code is not None and last.trainer and start_step == last.start_step:
        return False, f"no progress: the previous attempt started and ended at checkpoint step {start_step}"
    preempted = _count(previous, "preempted", "killed")
    if preempted > limits.max_preemptions:
        return False, f"preempted {preempted} times, more than max_preemptions={limits.max_preemptions}"
    timeouts = _count(previous, "time_limit")
    if timeouts > limits.max_requeues:
        return False, f"hit the time limit {timeouts} times, more than max_requeues={limits.max_requeues}"
    return True, f"restart {len(previous)} after {last.ended_cause}"


def decide_end(attempts: Sequence[Attempt], exit_code: int, limits: Limits) -> tuple[bool, str]:
    """Should the job be requeued after this attempt (the last of `attempts`)? (requeue, reason)."""
    if exit_code != REQUEUE_EXIT_CODE:
        return False, "completed" if exit_code == 0 else f"failed with exit code {exit_code}"
    if not attempts[-1].trained:
        return False, "it asked to be requeued before training started (crash loop guard)"
    cause = attempts[-1].cause or "preempted"
    if cause == "time_limit":
        used, cap, name = _count(attempts, "time_limit"), limits.max_requeues, "max_requeues"
    else:
        used, cap, name = _count(attempts, "preempted", "killed"), limits.max_preemptions, "max_preemptions"
    if used > cap:
        return False, f"{cause}: {used} requeues would exceed {name}={cap}"
    return True, f"{cause}: requeue {used} of at most {cap}"


# ---- the edge: what the batch script and the local executor call ----

def _limits(run_dir: Path) -> Limits:
    from .runner import load_spec

    spec = load_spec(run_dir / "spec.json")
    return Limits(spec.max_requeues, spec.max_preemptions)


def begin(run_dir: Path, attempt: int, env: dict[str, str] | None = None) -> tuple[bool, str]:
    env = dict(os.environ if env is None else env)
    events = JsonLines(run_dir / "events.jsonl")
    job_id = env.get("SLURM_JOB_ID") or env.get("HPC_DDP_JOB_ID")
    previous = attempts_from_events(read_jsonl(run_dir / "events.jsonl"), job_id)
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


def end(run_dir: Path, attempt: int, exit_code: int, env: dict[str, str] | None = None) -> tuple[bool, str]:
    env = dict(os.environ if env is None else env)
    events = JsonLines(run_dir / "events.jsonl")
    job_id = env.get("SLURM_JOB_ID") or env.get("HPC_DDP_JOB_ID")
    attempts = attempts_from_events(read_jsonl(run_dir / "events.jsonl"), job_id)
    if not attempts:
        attempts = [Attempt(attempt, None)]
    last = attempts[-1]
    if last.checkpointed and exit_code != 0:
        # The trainer's record wins over srun's exit code: with --kill-on-bad-exit, the ranks that were
        # still exiting after the checkpoint (code 75 counts as "bad") are killed, and srun reports 143.
        exit_code = REQUEUE_EXIT_CODE
    last.exit_code, last.ended_at = exit_code, time.time()
    if exit_code == REQUEUE_EXIT_CODE:
        last.cause = last.cause or _cause_from_deadline(env)
    else:
        last.cause = "completed" if exit_code == 0 else "failed"
    requeue, reason = decide_end(attempts, exit_code, _limits(run_dir))
    events.write({"event": "attempt_end", "attempt": attempt, "exit_code": exit_code, "cause": last.cause})
    if exit_code == REQUEUE_EXIT_CODE:
        events.write({"event": "requeue" if requeue else "gave_up", "attempt": attempt, "reason": reason})
    return requeue, reason


def _cause_from_deadline(env: dict[str, str]) -> str:
    """For programs that exit 75 without saying why (user scripts): near the job's end time, a time limit."""
    from .deadline import job_deadline

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
            requeue, reason = end(Path(args[1]), int(args[2]), int(args[3]))
            print("requeue" if requeue else "stop", flush=True)
            print(f"hpc-ddp: attempt {args[2]} ended: {reason}", file=sys.stderr, flush=True)
            return 0
    except (OSError, ValueError) as exc:
        print(f"hpc-ddp attempts: error: {exc}", file=sys.stderr)
        return 1
    print("usage: python -m hpc_ddp.attempts begin RUN_DIR ATTEMPT | end RUN_DIR ATTEMPT EXIT_CODE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
