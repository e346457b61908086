"""Asynchronous checkpoints: how long a save blocks the training loop, and how fast the loop runs while
the background write is going on.

The state is a model sized for it: two 8192 x 8192 linear layers with SGD momentum, about 1.07 GB (quick
mode: 2048 wide, 67 MB). Both sides go through the public API, `Session.save` at world size 1 on the
CPU, into the same kind of run dir:
- blocking: a Session with `async_checkpoint=False`: the whole crash-safe save (serialize, temp dir,
  fsync, manifest with sha256, rename, `latest`) blocks the loop;
- async: `save(wait=False)`, what `step()` does for a periodic checkpoint: the loop is blocked only for
  the snapshot into host memory (the same buffers as the previous save's, as in a long run);
  the same crash-safe write then runs in the background thread.
Blocking seconds are the time `save()` takes to return. Steps/s during a save: up to WINDOW training
steps of this model, run from the moment the async save returns while its write is in flight (fewer if
the write ends first), against WINDOW steps just before it with no save. The writer runs at the lowest
CPU priority, so while the loop keeps every core busy the write takes longer (it finishes at full speed
once the loop waits for it: at a stop, or the next save); `extra.seconds_to_durable` is the time from
the save to durable with the loop stopped after the window. `sync` runs before each timed save, so none pays for another's
writeback. One untimed async save first allocates the host buffers; its blocking time is recorded
(`extra.first_save_blocking_s`): the first periodic save of a run pays it once.
"""

from __future__ import annotations

import os
import shutil
import time

from .common import Row, Target, Workspace, compare, interleaved, say

SECTION = "async_checkpoint"
WINDOW = 8  # training steps timed with and without a write in flight (about 1 s each at full size)


class Model:
    """The model being checkpointed, and its training step."""

    def __init__(self, width: int):
        import torch
        from torch import nn

        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        self.opt = torch.optim.SGD(self.net.parameters(), lr=1e-4, momentum=0.9)
        self.x, self.y = torch.randn(4, width), torch.randn(4, width)
        self.step()  # creates the momentum buffers

    def step(self) -> None:
        import torch

        loss = torch.nn.functional.mse_loss(self.net(self.x), self.y)
        self.opt.zero_grad(set_to_none=False)
        loss.backward()
        self.opt.step()

    def steps_per_s(self, steps: int) -> float:
        started = time.perf_counter()
        for _ in range(steps):
            self.step()
        return steps / (time.perf_counter() - started)


def session(run_dir, model: Model, *, background: bool):
    from hpc_ddp.job.distenv import from_environ
    from hpc_ddp.trainer.session import Session

    run = Session(run_dir, env=from_environ({}, pid=os.getpid()), keep=2, checkpoint_every_minutes=0,
                  async_checkpoint=background)
    run.track(model=model.net, optimizer=model.opt)
    return run


def run(ws: Workspace) -> list[Row]:
    width, window = (2048, 3) if ws.s.quick else (8192, WINDOW)
    model = Model(width)
    root = ws.fresh("async-ckpt")
    sync_run = session(root / "sync", model, background=False)
    async_run = session(root / "async", model, background=True)
    nbytes = sum(t.numel() * t.element_size() for t in model.net.state_dict().values()) * 2
    durable: dict[str, list[float]] = {"sync": [], "async": []}
    rates: dict[str, list[float]] = {"without": [], "during": []}

    def blocking(n: int) -> float:
        os.sync()
        started = time.perf_counter()
        sync_run.save("periodic")
        seconds = time.perf_counter() - started
        durable["sync"].append(seconds)
        return seconds

    def background(n: int) -> float:
        os.sync()
        without = model.steps_per_s(window)
        started = time.perf_counter()
        async_run.progress.step += 1  # a new step each time, as in a run
        async_run.save("periodic", wait=False)
        blocked = time.perf_counter() - started
        steps, began = 0, time.perf_counter()
        while steps < window and async_run._writer.busy:
            model.step()
            steps += 1
        during = steps / (time.perf_counter() - began)
        async_run.wait_for_checkpoint()
        durable["async"].append(time.perf_counter() - started)
        rates["without"].append(without)
        rates["during"].append(during)
        say(f"    {steps} steps while the write was in flight: {during:.2f} steps/s; before it, {without:.2f}")
        return blocked

    try:
        started = time.perf_counter()
        async_run.save("periodic", wait=False)
        first = time.perf_counter() - started
        async_run.wait_for_checkpoint()
        repeats = max(ws.s.repeats - 2, 1)
        say(f"async checkpoint, {nbytes / 1e9:.2f} GB state: {repeats} repeats (first save blocked {first:.2f} s)")
        runs = interleaved({"blocking save": blocking, "async save (blocking part)": background}, repeats, "s")
    finally:
        sync_run.close()
        async_run.close()
        shutil.rmtree(root, ignore_errors=True)
    gb = nbytes / 1e9
    extra = {"state_bytes": nbytes, "width": width, "first_save_blocking_s": first,
             "seconds_to_durable": durable, "steps_per_s": rates}
    note = f"2 x Linear({width}, {width}) + SGD momentum, CPU, Session.save at world size 1"
    return [
        compare(SECTION, f"checkpoint: loop blocked by a save ({gb:.2f} GB), async vs blocking", "s",
                ours="save(wait=False): snapshot to host memory", ours_samples=runs["async save (blocking part)"],
                baseline="blocking crash-safe save", baseline_samples=runs["blocking save"],
                target=Target("<=", 0.10), extra=extra, note=note),
        compare(SECTION, "training steps/s during a background save vs without", "steps/s",
                ours="steps/s while the write runs", ours_samples=rates["during"],
                baseline="steps/s just before, no save", baseline_samples=rates["without"],
                target=Target(">=", 0.90), note=note),
    ]
