"""Training throughput on CPU: the built-in trainer against the plain hand-written loop (bench/plain_ddp.py).

Same model (the small CNN), data (a generated MNIST-format set read through torchvision's MNIST), batch
size, loader workers and world size, gloo, both started by the local executor, so only the loop
differs. World size 2 is the headline; world size 1 shows the trainer without DDP (it wraps the model
only when there is more than one rank) and what DDP itself costs at one rank.
"""

from __future__ import annotations

import json

from .common import (
    PLAIN,
    Row,
    Target,
    Workspace,
    compare,
    interleaved,
    say,
    trainer_job,
    trainer_rate,
)

SECTION = "training"


def _plain(ws: Workspace, tasks: int, ddp: bool = True):
    def run(n: int) -> float:
        out = ws.fresh("plain").with_suffix(".json")
        s = ws.s
        ws.run(ws.submit_argv("--tasks-per-node", str(tasks), "--run-dir", str(ws.fresh("plain-run")), str(PLAIN),
                              "--", "--data", str(ws.mnist()), "--steps", str(s.train_steps), "--batch", str(s.batch),
                              "--workers", str(s.workers), "--warm", str(s.warm), "--out", str(out),
                              *([] if ddp else ["--no-ddp"])), "plain")
        return json.loads(out.read_text())["samples_per_s"]
    return run


def _ours(ws: Workspace, tasks: int):
    s = ws.s
    job = trainer_job(ws.fresh("job").with_suffix(".toml"), data=str(ws.mnist()), steps=s.train_steps,
                      batch=s.batch, workers=s.workers, tasks=tasks, log_every=s.warm)

    def run(n: int) -> float:
        run_dir = ws.fresh("ours-run")
        ws.run(ws.submit_argv("--run-dir", str(run_dir), str(job)), "ours")
        return trainer_rate(run_dir, warm=s.warm, samples_per_step=s.batch * tasks)
    return run


def run(ws: Workspace) -> list[Row]:
    s = ws.s
    say(f"training throughput, world size 2: {s.train_steps} steps x {s.batch} per rank, {s.train_repeats} repeats")
    two = interleaved({"plain DDP loop": _plain(ws, 2), "trainer": _ours(ws, 2)}, s.train_repeats, "samples/s")
    say("training throughput, world size 1")
    one = interleaved({"plain loop, no DDP": _plain(ws, 1, ddp=False), "plain loop, DDP": _plain(ws, 1),
                       "trainer": _ours(ws, 1)}, s.train_repeats, "samples/s")
    common = {"note": f"{s.train_steps} steps (first {s.warm} excluded), batch {s.batch}/rank, "
                      f"{s.workers} loader workers/rank, gloo, CPU"}
    return [
        compare(SECTION, "training, CPU, world size 2", "samples/s", ours="hpc-ddp trainer",
                ours_samples=two["trainer"], baseline="hand-written DDP loop",
                baseline_samples=two["plain DDP loop"], target=Target(">=", 1.00), **common),
        compare(SECTION, "training, CPU, world size 1", "samples/s", ours="hpc-ddp trainer (no DDP at 1 rank)",
                ours_samples=one["trainer"], baseline="hand-written loop, no DDP",
                baseline_samples=one["plain loop, no DDP"], target=Target(">=", 1.00), **common),
        compare(SECTION, "DDP wrapper at world size 1 (plain loop)", "samples/s", ours="plain loop with DDP (gloo)",
                ours_samples=one["plain loop, DDP"], baseline="plain loop without DDP",
                baseline_samples=one["plain loop, no DDP"], **common),
    ]
