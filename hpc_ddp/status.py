"""`hpc-ddp status` and `hpc-ddp logs`: what the scheduler says about a job, plus what its run dir
recorded (attempts, why each ended, checkpoints, progress, the failure's likely cause).

Slurm's view comes from squeue, then sacct where accounting exists, then `scontrol show job`, each
falling back cleanly to the next; the run dir's events.jsonl fills in the rest.

What these print is masked (`secrets`): under sbatch, Slurm writes the rank logs itself, so a token a
program printed is on disk as printed; status details quote those logs, and `logs` prints them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import secrets
from .attempts import attempts_from_events, latest_checkpoint_step
from .classify import classify_failure
from .events import read_jsonl
from .procs import CommandRunner

__all__ = ["run_status", "scheduler_state", "log_files", "new_log_lines", "format_status"]

_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
          "DEADLINE")


def scheduler_state(job_id: str, commands: CommandRunner) -> dict[str, Any]:
    """{'state', 'reason', 'source'} from squeue, else sacct, else scontrol; {} if Slurm knows nothing."""
    queue = commands.run(["squeue", "-h", "-j", job_id, "-o", "%T|%r"], timeout=20)
    if queue.returncode == 0 and queue.stdout.strip():
        state, _, reason = queue.stdout.strip().splitlines()[0].partition("|")
        return {"state": state, "reason": None if reason in ("None", "") else reason, "source": "squeue"}
    acct = commands.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"], timeout=20)
    if acct.returncode == 0 and acct.stdout.strip():
        state, _, code = acct.stdout.strip().splitlines()[-1].partition("|")
        return {"state": state.split()[0], "exit_code": code, "source": "sacct"}
    show = commands.run(["scontrol", "show", "job", job_id], timeout=20)
    if show.returncode == 0:
        state = re.search(r"JobState=(\S+)", show.stdout)
        reason = re.search(r"Reason=(\S+)", show.stdout)
        code = re.search(r"ExitCode=(\S+)", show.stdout)
        if state:
            return {"state": state.group(1), "reason": reason.group(1) if reason and reason.group(1) != "None" else None,
                    "exit_code": code.group(1) if code else None, "source": "scontrol"}
    return {}


def _local_state(run_dir: Path) -> dict[str, Any]:
    """RUNNING while the executor that wrote local.pid runs: that very process (start time, command
    line), not whichever took its pid after it was killed."""
    from .procs import read_pid_file

    who, _, _ = read_pid_file(run_dir / "local.pid")
    return {"state": "RUNNING", "source": "local", "pid": who.pid} if who else {}


def _current_job(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of the newest job in the run dir (from its first attempt): a job submitted again to
    resume is judged on its own, not on why the one before it stopped."""
    starts = [e for e in events if e.get("event") == "attempt_start"]
    if not starts:
        return events
    job = starts[-1].get("job_id")
    first = next(i for i, e in enumerate(events) if e.get("event") == "attempt_start" and e.get("job_id") == job)
    return events[first:]


def log_files(run_dir: Path, rank: int | None = None) -> list[tuple[int, int, Path]]:
    """(attempt, rank, path) for every per-rank log, in attempt then rank order."""
    found = []
    for path in run_dir.glob("logs/job-*/attempt-*/rank-*.log"):
        attempt = int(path.parent.name.removeprefix("attempt-"))
        r = int(path.stem.removeprefix("rank-"))
        if rank is None or r == rank:
            found.append((attempt, r, path))
    return sorted(found, key=lambda t: (t[0], t[1], str(t[2])))


def new_log_lines(run_dir: Path, rank: int | None, offsets: dict[str, int], *,
                  whole_lines: bool = False) -> Iterator[str]:
    """`[attempt A rank R] line` for every line written since `offsets` (updated), secrets masked.
    `whole_lines` (while following a running job): leave a line still being written for the next call,
    so a token split across two reads is masked whole."""
    scrub = secrets.current()
    for attempt, r, path in log_files(run_dir, rank):
        with open(path, "rb") as fh:
            start = offsets.get(str(path), 0)
            fh.seek(start)
            data = fh.read()
        if whole_lines:
            data = data[:data.rfind(b"\n") + 1]
        offsets[str(path)] = start + len(data)
        for line in scrub.lines(data.decode(errors="replace").splitlines()):
            yield f"[attempt {attempt} rank {r}] {line}"


def _failure(run_dir: Path) -> dict[str, str] | None:
    files = log_files(run_dir)
    if not files:
        return None
    last_attempt = files[-1][0]
    texts = [p.read_text(errors="replace")[-200_000:] for a, _, p in files if a == last_attempt]
    texts += [p.read_text(errors="replace")[-50_000:] for p in run_dir.glob("logs/slurm-*.out")]
    found = classify_failure(texts)
    return {"kind": found[0], "detail": secrets.current()(found[1])} if found else None


def run_status(run_dir: Path, job_id: str | None, executor: str | None, commands: CommandRunner) -> dict[str, Any]:
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    attempts = attempts_from_events(events)
    sched = _local_state(run_dir) if executor == "local" else (
        scheduler_state(job_id, commands) if job_id and commands.which("squeue") else {})
    total = next((e.get("total_steps") for e in events if e.get("event") == "start"), None)
    step = metrics[-1]["step"] if metrics else None
    current = _current_job(events)
    gave_up = next((e["reason"] for e in reversed(current) if e.get("event") == "gave_up"), None)
    state = _overall_state(sched, current, gave_up)
    status = {
        "run_dir": str(run_dir), "job_id": job_id, "executor": executor, "state": state,
        "scheduler": sched or None, "restarts": max(len(attempts) - 1, 0),
        "attempts": [{"attempt": a.number, "start_step": a.start_step, "ended": a.ended_cause if a.exit_code is not None
                      or a is not attempts[-1] else ("running" if state in ("RUNNING", "PENDING") else "killed"),
                      "exit_code": a.exit_code} for a in attempts],
        "last_checkpoint_step": latest_checkpoint_step(run_dir), "step": step, "total_steps": total,
        "progress": round(step / total, 4) if step and total else None,
        "samples_per_s": metrics[-1].get("samples_per_s") if metrics else None,
        "last_event": events[-1] if events else None, "gave_up": gave_up,
        "resumes": [{"step": e["step"], "epoch": e.get("epoch"), "from": Path(e["path"]).name}
                    for e in events if e.get("event") == "resume"],
        "failure": _failure(run_dir) if state in ("FAILED", "STOPPED") else None,
    }
    # events.jsonl is masked as written; this also covers records written before masking existed.
    return secrets.current().deep(status)


def _overall_state(sched: dict[str, Any], events: list[dict[str, Any]], gave_up: str | None) -> str:
    live = sched.get("state")
    if live and live not in _ENDED:
        return live
    kinds = [e.get("event") for e in events]
    if any(e.get("event") == "gave_up" and e.get("cause") == "cancelled" for e in events) or (
            live == "CANCELLED" and "finish" not in kinds):  # the batch shell may be killed before it says so
        return "CANCELLED"
    if "finish" in kinds and kinds[-1] in ("finish", "attempt_end") and not gave_up:
        return "COMPLETED"
    if gave_up:
        return "STOPPED"
    ends = [e for e in events if e.get("event") == "attempt_end"]
    if ends and ends[-1].get("exit_code") == 0:
        return "COMPLETED"
    if ends and ends[-1].get("exit_code") not in (None, 0):
        return "FAILED"
    return live or ("UNKNOWN" if not events else "ENDED")


def format_status(s: dict[str, Any]) -> Iterator[str]:
    sched = s["scheduler"] or {}
    where = f" ({sched['reason']})" if sched.get("reason") else ""
    yield f"job {s['job_id'] or '-'} ({s['executor'] or '?'})  {s['state']}{where}"
    yield f"run dir          {s['run_dir']}"
    if s["step"] is not None:
        of = f"/{s['total_steps']} ({s['progress']:.0%})" if s["total_steps"] else ""
        yield f"progress         step {s['step']}{of}, {s['samples_per_s']} samples/s"
    yield f"last checkpoint  step {s['last_checkpoint_step']}" if s["last_checkpoint_step"] is not None \
        else "last checkpoint  none"
    yield f"restarts         {s['restarts']}"
    for a in s["attempts"]:
        yield f"  attempt {a['attempt']}: started at checkpoint step {a['start_step']}, ended: {a['ended']}" + (
            f" (exit code {a['exit_code']})" if a["exit_code"] not in (None, 0) else "")
    for r in s["resumes"]:
        yield f"  resumed at step {r['step']} from {r['from']}"
    if s["gave_up"]:
        yield f"not requeued     {s['gave_up']}"
    if s["failure"]:
        yield f"failure          {s['failure']['kind']}: {s['failure']['detail']}"
    if s["last_event"]:
        e = s["last_event"]
        yield "last event       " + ", ".join(f"{k}={v}" for k, v in e.items() if k != "time")
