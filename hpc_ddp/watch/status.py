"""`hpc-ddp status` and `hpc-ddp logs`: what the scheduler says about a job, plus what its run dir
recorded (attempts, why each ended, checkpoints, progress, the failure's likely cause).

Slurm's view comes from squeue, then sacct where accounting exists, then `scontrol show job`, each
falling back cleanly to the next (`slurm.jobstate`, asked through the run's executor); the run dir's
events.jsonl fills in the rest. Where the time went (one
line) comes from `timeline`; the ETA (`estimate_eta`, pure) from metrics.jsonl, the time limit and the
requeues still allowed.

What these print is masked (`secrets`): under sbatch, Slurm writes the rank logs itself, so a token a
program printed is on disk as printed; status details quote those logs, and `logs` prints them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpc_ddp.common import rundir, secrets
from hpc_ddp.common.durable import read_tail
from hpc_ddp.common.events import read_jsonl
from hpc_ddp.common.procs import CommandRunner
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.job.attempts import attempts_from_events, current_job, latest_checkpoint_step
from hpc_ddp.launch.executors.base import Run
from hpc_ddp.slurm.jobstate import ENDED, accounting
from hpc_ddp.spec.sweep import describe
from hpc_ddp.watch.classify import classify_failure
from hpc_ddp.watch.startover import framework_resumes, start_overs

__all__ = ["run_status", "log_files", "new_log_lines", "format_status", "Eta", "estimate_eta",
           "recent_step_seconds", "progress_line", "LIVE",
           "submitted_at", "records", "with_accounting", "format_runs"]

# A job in one of these may still train: `status --watch` and `logs --follow` keep going.
LIVE = ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING",
        "SUSPENDED", "STOPPED_BY_SLURM")


def log_files(run_dir: Path, rank: int | None = None) -> list[tuple[int, int, Path]]:
    """(attempt, rank, path) for every per-rank log, in attempt then rank order."""
    return RunDir(run_dir).rank_logs(rank)


def new_log_lines(run_dir: Path, rank: int | None, offsets: dict[str, int], *,
                  whole_lines: bool = False) -> Iterator[str]:
    """`[attempt A rank R] line` for every line written since `offsets` (updated), secrets masked.
    `whole_lines` (while following a running job): leave a line still being written for the next call,
    so a token split across two reads is masked whole."""
    for entry in new_log_entries(run_dir, rank, offsets, whole_lines=whole_lines):
        yield entry.text


@dataclasses.dataclass(frozen=True)
class LogEntry:
    """One line of a rank's log: `text` as `logs` prints it, and where it ends in `path`. A line the
    terminal would show as several (a progress bar's carriage returns) is `parts` entries, `part` 0..n-1,
    all ending where its newline does: a reader that stopped after part k resumes at the line's start
    and skips k+1 parts (`logs -f` over a connection that dropped)."""

    path: str
    end: int
    part: int
    parts: int
    text: str


_LOG_CHUNK = 16 << 20   # a rank's log is read this much at a time: a log of gigabytes never sits in memory whole


def new_log_entries(run_dir: Path, rank: int | None, offsets: dict[str, int], *,
                    whole_lines: bool = False) -> Iterator[LogEntry]:
    """The entries of `new_log_lines`, with where each ends (`offsets` updated as they are read). A log
    that is not a regular file (a FIFO, a device behind a link) is skipped, never waited on."""
    scrub = secrets.current()
    for attempt, r, path in log_files(run_dir, rank):
        key = str(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
        except OSError:
            continue  # gone since it was listed, or unreadable: nothing to show
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            start = offsets.get(key, 0)
            while True:
                fh.seek(start)
                data = fh.read(_LOG_CHUNK)
                full = len(data) == _LOG_CHUNK
                if full or whole_lines:  # a line cut by the chunk, or still being written: the next read's
                    cut = data.rfind(b"\n") + 1
                    data = data[:cut] if cut or not full else data
                if not data:
                    break
                yield from _entries(key, start, data, attempt, r, scrub)
                start += len(data)
                offsets[key] = start
                if not full:
                    break


def _entries(key: str, start: int, data: bytes, attempt: int, r: int, scrub) -> Iterator[LogEntry]:
    chunks = data.split(b"\n")
    if chunks[-1] == b"":
        chunks.pop()
    ends, at = [], start
    texts: list[str] = []
    for chunk in chunks:
        at += len(chunk) + 1
        lines = chunk.decode(errors="replace").splitlines() or [""]
        ends += [(min(at, start + len(data)), k, len(lines)) for k in range(len(lines))]
        texts += lines
    for (end, part, parts), line in zip(ends, scrub.lines(texts)):
        yield LogEntry(key, end, part, parts, f"[attempt {attempt} rank {r}] {line}")


def _failure(run_dir: Path, events: list[dict[str, Any]]) -> dict[str, str] | None:
    """Why the last attempt failed, from its ranks' logs (and the batch shells' output). Only that
    attempt's folder is read: listing every attempt's logs costs ranks x attempts metadata operations
    (1.6 million entries at 1,024 nodes x 8 ranks x 200 attempts), and attempt numbers restart in each job
    of a chain, so the newest attempt is the one the newest attempt_start names."""
    paths = RunDir(run_dir)
    start = next((e for e in reversed(events) if e.get("event") == "attempt_start" and e.get("job_id") is not None
                  and isinstance(e.get("attempt"), int)), None)
    # the stall watch's own record (trainer/sessionstep.py) says what hung: a rank 0 that hangs is named there,
    # while the logs around it speak of the rendezvous store it holds
    since = events[len(events) - 1 - events[::-1].index(start):] if start is not None else events
    stalled = next((e for e in reversed(since) if e.get("event") == "stalled"), None)
    if stalled is not None:
        return {"kind": "stalled", "detail": secrets.current()(str(stalled.get("reason") or "no step completed"))[:300]}
    if start is not None:
        folder = paths.attempt_logs(str(start["job_id"]), start["attempt"])
        files = sorted(folder.glob(rundir.RANK_LOG.format(rank="*"))) if folder.is_dir() else []
    else:  # a run dir from before attempt records named their job
        every = log_files(run_dir)
        files = [p for a, _, p in every if a == every[-1][0]] if every else []
    texts = [read_tail(p, 200_000).decode(errors="replace") for p in files]  # a log of GBs: its end only
    texts += [read_tail(p, 50_000).decode(errors="replace") for p in paths.slurm_outputs()]
    found = classify_failure(texts)
    return {"kind": found[0], "detail": secrets.current()(found[1])} if found else None


def run_status(run_dir: Path, job_id: str | None, executor: str | None, commands: CommandRunner,
               sched: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything `status` shows of one run. `sched`: what the scheduler says, where the caller asked
    already (a sweep asks once for all its tasks)."""
    events = records(RunDir(run_dir).events)
    every_metric = records(RunDir(run_dir).metrics)
    metrics = [m for m in every_metric if "loss" in m and isinstance(m.get("step"), int)]
    attempts = attempts_from_events(events)
    from hpc_ddp.launch.executors import executor_for_run

    if sched is None:
        sched = executor_for_run(executor, commands).state(Run(run_dir, job_id, executor))
    total = next((e.get("total_steps") for e in events if e.get("event") == "start"), None)
    step = metrics[-1]["step"] if metrics else None
    current = current_job(events)
    gave_up = next((e["reason"] for e in reversed(current) if e.get("event") == "gave_up"), None)
    state = _overall_state(sched, current, gave_up)
    line, eta, goodput = _time_accounting(run_dir, events, every_metric, job_id, step, total)
    status = {
        "run_dir": str(run_dir), "job_id": job_id, "executor": executor, "state": state,
        "scheduler": sched or None, "restarts": max(len(attempts) - 1, 0),
        "attempts": [{"attempt": a.number, "start_step": a.start_step, "ended": a.ended_cause if a.exit_code is not None
                      or a is not attempts[-1] else ("running" if state in ("RUNNING", "PENDING") else "killed"),
                      "exit_code": a.exit_code, "job_id": a.job_id, "code": a.code, "environment": env,
                      "nodes": start.get("nodes")}
                     for a, env, start in zip(attempts, _environments(events),
                                              (e for e in events if e.get("event") == "attempt_start"))],
        "code": snapshots_of(events),
        "last_checkpoint_step": latest_checkpoint_step(run_dir), "step": step, "total_steps": total,
        "progress": round(step / total, 4) if step and total else None,
        "samples_per_s": metrics[-1].get("samples_per_s") if metrics else None,
        "last_event": events[-1] if events else None, "gave_up": gave_up,
        "resumes": [{"step": e.get("step"), "epoch": e.get("epoch"), "from": Path(str(e.get("path") or "?")).name}
                    for e in events if e.get("event") == "resume"],
        "failure": _failure(run_dir, events) if state in ("FAILED", "STOPPED") else None,
        "time_used": line, "eta": dataclasses.asdict(eta) if eta and state in LIVE else None, **goodput,
        "debugger": _debugger(current) if state in LIVE else None,
        "checkpoint_interval": _checkpoint_interval(current),
        "memory": next((e for e in reversed(current) if e.get("event") == "memory"), None),
    }
    # events.jsonl is masked as written; this also covers records written before masking existed.
    return secrets.current().deep(status)


def _checkpoint_interval(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The checkpoint interval in effect (checkpoint_every_minutes = "auto", trainer/interval.py): the
    current job's last "checkpoint_interval" record, its value and the one line that says why."""
    chosen = next((e for e in reversed(events) if e.get("event") == "checkpoint_interval"), None)
    if chosen is None or not isinstance(chosen.get("seconds"), (int, float)) or not math.isfinite(chosen["seconds"]):
        return None
    why = chosen.get("why") if isinstance(chosen.get("why"), str) else ""
    clamped = chosen.get("clamped") if isinstance(chosen.get("clamped"), str) else None
    return {"seconds": chosen["seconds"], "why": why, "clamped": clamped,
            "sources": chosen.get("sources") if isinstance(chosen.get("sources"), dict) else {}}


def snapshots_of(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every code snapshot the run dir was submitted with, by id: the newest record of each (project,
    git commit, branch, dirty, the diff's file)."""
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.get("event") == "snapshot" and isinstance(e.get("code"), str):
            git = e.get("git") if isinstance(e.get("git"), dict) else {}
            out[e["code"]] = {"project": e.get("project"), "commit": git.get("commit"), "branch": git.get("branch"),
                              "dirty": git.get("dirty"), "patch": e.get("patch"), "git": bool(git),
                              "changes": e.get("changes"), "previous": e.get("previous")}
    return out


def _environments(events: list[dict[str, Any]]) -> Iterator[dict[str, Any] | None]:
    """Each attempt's environment (rank 0 records it after the attempt's start: job.provenance), in the order
    of the attempts: the record between its attempt_start and the next one. With what changed in it since
    the attempt before."""
    keys = ("python", "torch", "cuda", "nccl", "packages", "package_count", "executable", "node", "changed")
    current: dict[str, Any] | None = None
    started = False
    for e in events:
        if e.get("event") == "attempt_start":
            if started:
                yield current
            started, current = True, None
        elif e.get("event") == "environment" and started and current is None:
            current = {k: e.get(k) for k in keys if k in e}
    if started:
        yield current


def code_line(code: str | None, snapshots: dict[str, dict[str, Any]]) -> str:
    """`code 3f9a... (git abc1234 on main + uncommitted changes: code/<diff>)`: what one attempt ran."""
    if not code:
        return "code not pinned (the working tree as it was)"
    s = snapshots.get(code) or {}
    if not s.get("git"):
        return f"code {code}" + (" (not in git)" if s else "")
    where = f"git {str(s['commit'])[:12] if s.get('commit') else 'no commits yet'}" + (
        f" on {s['branch']}" if s.get("branch") else "")
    dirty = f" + uncommitted changes ({'code/' + s['patch'] if s.get('patch') else 'untracked files'})" \
        if s.get("dirty") else ", clean"
    return f"code {code} ({where}{dirty})"


def environment_line(env: dict[str, Any] | None) -> str | None:
    if not env:
        return None
    parts = [f"python {env.get('python')}"] + [f"{k} {env[k]}" for k in ("torch", "cuda", "nccl") if env.get(k)]
    return ", ".join(parts) + f", packages {env.get('packages')}"


def _debugger(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The current attempt's debug rank (--debug-rank): where it listens and the tunnel to it."""
    start = max((i for i, e in enumerate(events) if e.get("event") == "attempt_start"), default=0)
    return next((e for e in reversed(events[start:]) if e.get("event") == "debugger"), None)


def memory_line(m: dict[str, Any]) -> str:
    """The trainer's `memory` record: what one rank holds of weights, gradients and optimizer state."""
    total = m.get("total_bytes")
    shown = f"{total / 2**20:,.1f} MiB" if isinstance(total, (int, float)) and not isinstance(total, bool) else "?"
    peak = m.get("peak_gpu_bytes")
    gpu = f"; GPU peak {peak / 2**30:,.2f} GiB" if isinstance(peak, (int, float)) and not isinstance(peak, bool) else ""
    return (f"memory per rank  {shown} of weights, gradients and optimizer state ({m.get('strategy', '?')}, "
            f"{m.get('world_size', '?')} ranks){gpu}")


def debugger_lines(d: dict[str, Any]) -> list[str]:
    timeouts = (f"(timeouts stretched: rendezvous {d.get('rendezvous_timeout')} s, "
                f"collective {d.get('collective_timeout')} s)")
    if d.get("debugger") == "pdb":
        return [f"debugger         rank {d.get('rank')} under pdb in the submitting terminal {timeouts}"]
    if not d.get("owner_only"):  # an event of an older hpc-ddp, whose rank listened itself
        return [f"debugger         rank {d.get('rank')} waits for debugpy on {d.get('listen')} {timeouts}",
                f"  tunnel         {d.get('tunnel')}  then attach to localhost:{d.get('port')}"]
    if d.get("loopback"):
        return [f"debugger         rank {d.get('rank')} waits for debugpy on {d.get('listen')}, your connections "
                f"only {timeouts}",
                f"  attach         localhost:{d.get('port')} on this machine",
                f"  tunnel         {d.get('tunnel')}  then attach to localhost:{d.get('port')}"]
    return [f"debugger         rank {d.get('rank')} waits for debugpy on {d.get('node')}, your connections only "
            f"{timeouts}",
            f"  attach         {d.get('attach')}  (on the login node; leave it running: it relays through srun)",
            f"  tunnel         {d.get('tunnel')}  then attach to localhost:{d.get('port')}"]


def records(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file: a damaged line (a kill mid-write) is skipped by read_jsonl, one that
    parses to something other than a record of ours here (`events.well_formed`: a step that is a string, a
    time that is NaN); a file that cannot be read is one line, exit 2."""
    from hpc_ddp.common.errors import UserError
    from hpc_ddp.common.events import well_formed

    try:
        return [r for r in read_jsonl(path) if well_formed(r)]
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {str(path)!r}: {getattr(exc, 'strerror', None) or exc}") from None


def _time_accounting(run_dir: Path, events: list[dict[str, Any]], metrics: list[dict[str, Any]],
                     job_id: str | None, step: int | None, total: int | None
                     ) -> tuple[str | None, "Eta | None", dict[str, Any]]:
    """The timeline's one-line summary, the ETA of the job's current attempt, and the run's goodput and
    restarts in place (`watch.goodput`)."""
    from hpc_ddp.watch.goodput import goodput, goodput_line
    from hpc_ddp.watch.timeline import build_timeline, in_place_line, summarize, summary_line

    timeline = build_timeline(events, metrics, submitted_at(run_dir))
    summary = summarize(timeline)
    spec = _spec(run_dir)
    current = timeline.spans[-1] if timeline.spans else None
    job_spans = [s for s in timeline.spans if s.job_id == job_id] if job_id else timeline.spans
    used = sum(1 for s in job_spans if s.cause == "time_limit")
    # How long an attempt takes from its start to its start/resume record (the first one's too: it starts
    # the same way), for the attempts to come and for the current one while it restarts.
    restarts = [s.train_start - s.start for s in timeline.spans if s.train_start is not None]
    restart = sum(restarts) / len(restarts) if restarts else 60.0
    now_metrics = [m for m in metrics if current and _after(m, current.start)]
    eta = estimate_eta(
        step=step, total_steps=total, step_seconds=recent_step_seconds(now_metrics) or timeline.step_seconds,
        now=time.time(), attempt_started=current.start if current else None,
        time_limit_s=getattr(spec, "time", None), signal_lead_s=getattr(spec, "signal_lead", 0),
        restart_s=restart,
        queue_s=sum(b - a for a, b in timeline.waits[1:]) / len(timeline.waits[1:]) if timeline.waits[1:] else 0.0,
        requeues_left=max(spec.max_requeues - used, 0) if spec is not None else None,
        # Restarting (no start/resume record yet): as long as this run's resumes took, less what has passed.
        startup_left_s=max(restart - (time.time() - current.start), 0.0)
        if current and current.train_start is None and restarts else 0.0)
    g = goodput(timeline)
    measured = summary.measured  # a script that reports no steps: no goodput to speak of, not "0%"

    heads = _log_heads(run_dir)
    extra = {"goodput": round(g.ratio, 4) if g.ratio is not None and measured else None,
             "goodput_text": goodput_line(g, getattr(spec, "gpus", 0) or 0) if measured else None,
             "restarted_in_place": summary.restarted_in_place,
             "restarted_in_place_text": in_place_line(summary) if summary.restarted_in_place else None,
             "start_overs": start_over_lines_of(run_dir, timeline, heads),
             "framework_resumes": {str(k): v for k, v in framework_resumes(heads).items()}}
    return summary_line(summary), eta, extra


def _log_heads(run_dir: Path) -> dict[int, str]:
    """The head of rank 0's log of each attempt after the first: what a framework prints as it begins."""
    return {attempt: read_tail(path, 200_000, head=True).decode(errors="replace")
            for attempt, _, path in log_files(run_dir, rank=0) if attempt > 0}


def start_over_lines_of(run_dir: Path, timeline: Any, heads: dict[int, str] | None = None) -> list[str]:
    """`watch.startover`'s lines for this run dir: from its records, and the head of rank 0's log of each
    later attempt (what a framework prints as it begins: Lightning's "no last checkpoint", HF's banner)."""
    return [over.line() for over in start_overs(timeline, _log_heads(run_dir) if heads is None else heads)]


def _after(record: dict[str, Any], t: float) -> bool:
    return isinstance(record.get("time"), (int, float)) and record["time"] >= t


def submitted_at(run_dir: Path) -> dict[str, float]:
    """job id -> when it was submitted: submissions.jsonl, else this user's registry of runs."""
    from hpc_ddp.watch.registry import runs

    here = str(run_dir.resolve())
    found = {str(r.get("job_id")): r["time"] for r in runs() if isinstance(r, dict)
             and str(Path(str(r.get("run_dir"))).resolve()) == here and isinstance(r.get("time"), (int, float))}
    for sub in records(RunDir(run_dir).submissions):
        if isinstance(sub.get("time"), (int, float)):
            found.setdefault(str(sub.get("job_id")), sub["time"])
    return found


def _spec(run_dir: Path):
    from hpc_ddp.common.errors import HpcDdpError
    from hpc_ddp.spec.jobspec import load_spec

    try:
        return load_spec(RunDir(run_dir).spec)
    except HpcDdpError:  # a script run without hpc-ddp has none: no time limit to plan for
        return None


@dataclasses.dataclass(frozen=True)
class Eta:
    seconds: float | None        # from now to the last step; None: it cannot finish within the limits
    more_attempts: int           # requeues after a time limit it still needs
    requeues_left: int | None    # requeues after a time limit still allowed (None: no limit known)
    queue_known: bool = True     # the queue waits of those requeues are counted (from this run's own)

    @property
    def fits(self) -> bool:
        return self.seconds is not None and (self.requeues_left is None or self.more_attempts <= self.requeues_left)


def estimate_eta(*, step: int | None, total_steps: int | None, step_seconds: float | None, now: float,
                 attempt_started: float | None, time_limit_s: float | None, signal_lead_s: float = 0.0,
                 restart_s: float = 60.0, queue_s: float = 0.0, requeues_left: int | None = None,
                 startup_left_s: float = 0.0) -> Eta | None:
    """When the last step will be done. Without a time limit: the steps left x step time. With one, the
    attempt trains until `signal_lead_s` before its limit; each later attempt waits `queue_s` in the
    queue, spends `restart_s` starting and resuming, and trains for the limit less the lead and restart.
    `startup_left_s`: what the current attempt still needs before it trains (it is restarting).
    None when there is nothing to estimate from (no step, total or step time yet)."""
    if step is None or not total_steps or not step_seconds or step_seconds <= 0:
        return None
    work = max(total_steps - step, 0) * step_seconds
    if not time_limit_s or attempt_started is None:
        return Eta(startup_left_s + work, 0, requeues_left)
    elapsed = max(now - attempt_started, 0.0)
    left_now = max(time_limit_s - signal_lead_s - elapsed - startup_left_s, 0.0)
    if work <= left_now:
        return Eta(startup_left_s + work, 0, requeues_left)
    per_attempt = time_limit_s - signal_lead_s - restart_s
    if per_attempt <= 0:
        return Eta(None, 0, requeues_left)  # a restart alone eats the time limit: it never gets further
    more = math.ceil((work - left_now) / per_attempt)
    last = work - left_now - (more - 1) * per_attempt
    seconds = max(time_limit_s - elapsed, 0.0) + (more - 1) * (time_limit_s + queue_s) + queue_s + restart_s + last
    return Eta(seconds, more, requeues_left, queue_known=queue_s > 0)


def recent_step_seconds(metrics: list[dict[str, Any]]) -> float | None:
    """Seconds per step between the last two training records (the current speed, not the run's)."""
    timed = [m for m in metrics if isinstance(m.get("time"), (int, float)) and isinstance(m.get("step"), int)
             and ("loss" in m or "samples_per_s" in m)]  # an eval record's time includes the evaluation
    if len(timed) < 2:
        return None
    a, b = timed[-2], timed[-1]
    return (b["time"] - a["time"]) / (b["step"] - a["step"]) if b["step"] > a["step"] else None


def eta_text(eta: dict[str, Any] | None, now: float) -> str | None:
    if not eta:
        return None
    from hpc_ddp.watch.timeline import duration

    more, left = eta["more_attempts"], eta["requeues_left"]
    if eta["seconds"] is None:
        return "will not finish: restarting takes longer than the time limit leaves"
    if left is not None and more > left:
        return f"will not finish: needs {more} more requeue(s) after time limits, max_requeues leaves {left}"
    at = time.strftime("%H:%M", time.gmtime(now + eta["seconds"]))
    text = f"{at} UTC (in {duration(eta['seconds'])})"
    if more:
        text += f", after {more} more requeue(s) at the time limit ({left} allowed)"
        text += "" if eta["queue_known"] else ", queue waits not counted"
    return text


def progress_line(s: dict[str, Any], now: float) -> str:
    """One line for `status --watch`: state, step, samples/s, ETA."""
    parts = [time.strftime("%H:%M:%S", time.gmtime(now)), s["state"]]
    if s["step"] is not None:
        parts.append(f"step {s['step']}" + (f"/{s['total_steps']} ({s['progress']:.0%})" if s["total_steps"] else ""))
    if s["samples_per_s"] is not None:
        parts.append(f"{s['samples_per_s']:,.0f} samples/s")
    eta = eta_text(s.get("eta"), now)
    if eta:
        parts.append(f"ETA {eta}")
    return "  ".join(parts)


def _overall_state(sched: dict[str, Any], events: list[dict[str, Any]], gave_up: str | None) -> str:
    live = sched.get("state")
    if live and live not in ENDED:
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
    if sched.get("source") == "sacct":
        yield f"slurm accounting {sched['state']}, elapsed {sched.get('elapsed')}, exit code {sched.get('exit_code')}"
    if len(sched.get("history") or []) > 1:  # requeued: every run Slurm accounted for
        yield "slurm runs       " + " -> ".join(
            f"{h['state']} {h['elapsed']}" + (f" on {h['nodelist']}" if h["nodelist"] not in ("", "None assigned")
                                              else "") for h in sched["history"])
    if s["step"] is not None:
        of = f"/{s['total_steps']} ({s['progress']:.0%})" if s["total_steps"] else ""
        yield f"progress         step {s['step']}{of}, {s['samples_per_s']} samples/s"
    eta = eta_text(s.get("eta"), time.time())
    if eta:
        yield f"eta              {eta}"
    if s.get("time_used"):
        yield f"time used        {s['time_used']}"
    if s.get("goodput_text"):
        yield f"goodput          {s['goodput_text']}"
    if s.get("restarted_in_place_text"):
        yield f"in allocation    {s['restarted_in_place_text']} (no requeue)"
    yield f"last checkpoint  step {s['last_checkpoint_step']}" if s["last_checkpoint_step"] is not None \
        else "last checkpoint  none"
    every = s.get("checkpoint_interval")
    if every:
        clamped = f"; {every['clamped']}" if every.get("clamped") else ""
        yield f"checkpoints      every {every['seconds'] / 60:.1f} min (auto: {every['why']}{clamped})"
    # requeues (a new attempt each) and restarts inside an allocation are both restarts: one line says both
    in_place = s.get("restarted_in_place") or 0
    yield (f"restarts         {s['restarts']} requeued, {in_place} in place" if in_place
           else f"restarts         {s['restarts']}")
    # Slurm numbers attempts per job: a chain's (or a requeue fallback's) next job starts at 0 again.
    several_jobs = len({a.get("job_id") for a in s["attempts"]}) > 1
    snapshots = s.get("code") or {}
    if snapshots and not s["attempts"]:  # queued, not started yet: the code it will run
        yield f"code             {code_line(list(snapshots)[-1], snapshots).removeprefix('code ')}"
    previous_code = None
    for n, a in enumerate(s["attempts"]):
        job = f" of job {a['job_id']}" if several_jobs and a.get("job_id") else ""
        job += f" on {a['nodes']}" if a.get("nodes") else ""
        said = (s.get("framework_resumes") or {}).get(str(a["attempt"])) if a["start_step"] is None else None
        began = f"started as its log says: {said}" if said else f"started at checkpoint step {a['start_step']}"
        yield f"  attempt {a['attempt']}{job}: {began}, ended: {a['ended']}" + (
            f" (exit code {a['exit_code']})" if a["exit_code"] not in (None, 0) else "")
        if a.get("code") or snapshots:
            new = " (a new snapshot: resubmitted)" if n and a.get("code") != previous_code else ""
            yield f"    {code_line(a.get('code'), snapshots)}{new}"
        previous_code = a.get("code")
        env = a.get("environment")
        if env:
            yield f"    {environment_line(env)} on {env.get('node')}"
            for change in env.get("changed") or []:
                yield f"    ! environment changed since the attempt before: {change}"
    for r in s["resumes"]:
        yield f"  resumed at step {r['step']} from {r['from']}"
    for line in s.get("start_overs") or ():
        yield line
    if s.get("memory"):
        yield memory_line(s["memory"])
    if s.get("debugger"):
        yield from debugger_lines(s["debugger"])
    if s["gave_up"]:
        yield f"not requeued     {s['gave_up']}"
    if s["failure"]:
        yield f"failure          {s['failure']['kind']}: {s['failure']['detail']}"
    if s["last_event"]:
        e = s["last_event"]
        yield "last event       " + ", ".join(f"{k}={v}" for k, v in e.items() if k != "time")


def with_accounting(runs: list[dict[str, Any]], commands: CommandRunner) -> list[dict[str, Any]]:
    """Registry records with what Slurm's accounting says of each queued job (state, elapsed time, exit
    code) under "slurm", in one sacct call; unchanged without accounting."""
    from hpc_ddp.launch.executors import executor_for_run

    ids = [str(r["job_id"]) for r in runs if _queued(r, executor_for_run) and _JOB_ID.fullmatch(str(r.get("job_id")))
           and not r.get("host")]  # a run submitted over ssh: its cluster's accounting (hpc_ddp.remote) says
    acct = accounting(ids, commands)
    for r in runs:
        last = (acct.get(str(r.get("job_id"))) or [None])[-1]
        if last:
            r["slurm"] = {"state": last["state"], "elapsed": last["elapsed"], "exit_code": last["exitcode"]}
        elif not r.get("host") and not _queued(r, executor_for_run):
            r["state"] = _foreground_state(r, executor_for_run)
    return runs


def _foreground_state(record: dict[str, Any], executor_for_run) -> str | None:
    """A local or srun run's state: RUNNING while its process runs, else how its run dir recorded the end
    (COMPLETED, CANCELLED, CHECKPOINTED, TIMEOUT, FAILED); None where neither says."""
    from hpc_ddp.common.errors import HpcDdpError

    try:
        run = Run(Path(str(record.get("run_dir"))), str(record.get("job_id")), str(record.get("executor")))
        if executor_for_run(record.get("executor")).state(run).get("state"):
            return "RUNNING"
        ended = [sub.get("state") for sub in records(RunDir(run.run_dir).submissions)
                 if isinstance(sub, dict) and str(sub.get("job_id")) == run.job_id and sub.get("state")]
    except (HpcDdpError, OSError, ValueError):
        return None
    return str(ended[-1]) if ended and ended[-1] != "RUNNING" else None


def _queued(record: dict[str, Any], executor_for_run) -> bool:
    try:
        return executor_for_run(record.get("executor")).queues
    except ValueError:  # a registry line from another version, naming an executor we do not have
        return False


_JOB_ID = re.compile(r"\d+(?:_\d+)?")  # a Slurm job id, or an array task's


def format_runs(runs: list[dict[str, Any]]) -> Iterator[str]:
    """`hpc-ddp list`: one line per run, newest last; a sweep's tasks under one line naming the sweep."""
    if not runs:
        yield "no runs yet"
        return
    yield f"{'JOB':28} {'EXECUTOR':8} {'STATE':10} {'ELAPSED':>10} {'NAME':20} RUN DIR"
    sweep = None
    for r in runs:
        slurm = r.get("slurm") or ({"state": r["state"]} if r.get("state") else {})
        if r.get("sweep") != sweep and r.get("sweep"):
            yield f"sweep {r['sweep']}" + (f" (array job {r['array_job_id']})" if r.get("array_job_id") else "")
        sweep = r.get("sweep")
        what = f"  task {r.get('task')}: {describe(r.get('values') or {})}" if sweep else r.get("run_dir")
        if r.get("host") and not sweep:
            what = f"{r['host']}:{what}"
        yield (f"{str(r.get('job_id')):28} {str(r.get('executor') or '?'):8} {str(slurm.get('state', '-')):10} "
               f"{str(slurm.get('elapsed', '-')):>10} {str(r.get('name') or ''):20} {what}")
