"""Preemption and resume: the trainer (2 ranks, CPU) under the local executor gets the real warning
signal (SIGUSR2 to the executor, which forwards it to every rank, as `hpc-ddp preempt` does) at a random
point inside a step; it checkpoints, exits 75, and the executor starts the next attempt, which resumes.

From the run's own records (events.jsonl, and metrics.jsonl with log_every = 1) and the time the
signal was sent:
- resume time: the restart's `attempt_start` -> its first step after resume; the baseline is the same
  run's fresh start (attempt 0's `attempt_start` -> step 1);
- steps run after the signal: the stop step minus the step in progress when the signal was sent;
- steps lost: the last step attempt 0 finished minus the step attempt 1 resumed from (work done again).
"""

from __future__ import annotations

import os
import random
import signal
import time

from .common import (
    BenchError,
    Row,
    Target,
    Workspace,
    absolute,
    compare,
    metrics,
    say,
    trainer_job,
    wait,
)

SECTION = "resume"


def _events(run_dir):
    from hpc_ddp.common.events import read_jsonl

    return read_jsonl(run_dir / "events.jsonl")


def preempt_once(ws: Workspace, job, rng: random.Random) -> dict:
    s = ws.s
    run_dir = ws.fresh("resume-run")
    proc, log = ws.spawn(ws.submit_argv("--run-dir", str(run_dir), str(job)), "resume")
    deadline = time.monotonic() + 300
    while True:  # wait for the signal step, then land the signal at a random point of the next step
        done = metrics(run_dir)
        if done and done[-1]["step"] >= s.resume_signal_after:
            break
        if proc.poll() is not None or time.monotonic() > deadline:
            wait(proc, log, timeout=1)
            raise BenchError(f"the run ended before step {s.resume_signal_after}; see {log}")
        time.sleep(0.01)
    step_s = (done[-1]["time"] - done[0]["time"]) / max(done[-1]["step"] - done[0]["step"], 1)
    time.sleep(rng.uniform(0, step_s))
    sent = time.time()
    os.kill(proc.pid, signal.SIGUSR2)
    wait(proc, log)
    events, records = _events(run_dir), metrics(run_dir)
    starts = {e["attempt"]: e["time"] for e in events if e["event"] == "attempt_start"}
    stop = next(e for e in events if e["event"] == "signal")
    saved = next(e for e in events if e["event"] == "checkpoint" and e.get("reason") == "stop")
    resumed = next(e for e in events if e["event"] == "resume")
    first = [r for r in records if r.get("restarts", 0) == 0]
    again = [r for r in records if r.get("restarts", 0) == 1]
    before = max((r["step"] for r in first if r["time"] <= sent), default=0)
    return {"fresh_start_s": first[0]["time"] - starts[0], "resume_s": again[0]["time"] - starts[1],
            "signal_during_step": before + 1, "stop_step": stop["step"], "checkpoint_step": saved["step"],
            "resumed_step": resumed["step"], "last_step_before_stop": max(r["step"] for r in first),
            "steps_after_signal": stop["step"] - (before + 1),
            "steps_lost": max(r["step"] for r in first) - resumed["step"],
            "stop_save_s": saved.get("seconds"), "signal_to_exit_s": _exit_time(events) - sent}


def _exit_time(events) -> float:
    return next(e["time"] for e in events if e["event"] == "attempt_end" and e.get("attempt") == 0)


def run(ws: Workspace) -> list[Row]:
    s = ws.s
    job = trainer_job(ws.fresh("resume-job").with_suffix(".toml"), data=str(ws.mnist()), steps=s.resume_steps,
                      batch=s.batch, workers=s.workers, tasks=2, log_every=1)
    rng = random.Random(7)
    runs = []
    say(f"preemption and resume: {s.repeats} runs, signal after step {s.resume_signal_after}")
    for n in range(s.repeats):
        runs.append(preempt_once(ws, job, rng))
        say(f"  #{n + 1}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in runs[-1].items()))
    note = "2 ranks, CPU; SIGUSR2 at a random point of a step"
    return [
        compare(SECTION, "resume: restart to first step after resume", "s", ours="resume (attempt 1)",
                ours_samples=[r["resume_s"] for r in runs], baseline="fresh start (attempt 0, same run)",
                baseline_samples=[r["fresh_start_s"] for r in runs],
                extra={"runs": runs}, note=note + "; attempt_start -> first step; lower is better"),
        absolute(SECTION, "preemption: steps begun after the signal", "steps", ours="trainer",
                 samples=[r["steps_after_signal"] for r in runs], target=Target("<=", 1, on="value"),
                 note="worst of the runs; the step in progress when the signal came is not counted"),
        absolute(SECTION, "preemption: steps lost (redone after resume)", "steps", ours="trainer",
                 samples=[r["steps_lost"] for r in runs], target=Target("<=", 1, on="value"),
                 note="worst of the runs"),
    ]
