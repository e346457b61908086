"""Checkpoint save throughput: our crash-safe save against plain ways of writing the same state.

The state is what the trainer saves for a ResNet (torchvision, full size): model weights, SGD state with
momentum buffers, a small train state. Three ways to write it, all to the same disk as the workspace:
- ours: `CheckpointManager.save` (serialize each payload, write to a temp dir, fsync every file and the
  manifest with sizes and sha256, fsync the dir, rename into place, replace `latest`, prune to keep=3:
  the steady state of a long run);
- `torch.save` of the same dict to one file, no fsync (fast, not durable: the data may be in the page
  cache only when it returns);
- the same bytes (torch.save to a BytesIO) written to one file with one fsync: the cheapest durable
  write, and the target's baseline.
MB/s = bytes written / seconds. `sync` runs before each timed save, so none pays for another's writeback.
The trainer adds `state_sha256` of the model (a fingerprint in the manifest) to every save; its cost is
measured separately. This is the blocking save (stops, finish, `async_checkpoint = false`); what a
periodic background save blocks is measured by async_ckpt_bench.py.
"""

from __future__ import annotations

import io
import os
import shutil
import statistics
import time

from .common import Row, Target, Workspace, compare, interleaved, say

SECTION = "checkpoint"


def make_state(model_name: str):
    import torch
    import torchvision.models as tvm

    torch.manual_seed(0)
    model = tvm.get_model(model_name, weights=None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    opt.step()  # creates the momentum buffers
    train_state = {"progress": {"step": 1000, "epoch": 3}, "rng": [torch.get_rng_state()] * 2}
    return {"model.pt": model.state_dict(), "optimizer.pt": opt.state_dict(), "train_state.pt": train_state}


def run(ws: Workspace) -> list[Row]:
    import torch

    from hpc_ddp.trainer.checkpoint import CheckpointManager, state_sha256

    state = make_state(ws.s.ckpt_model)
    root = ws.fresh("ckpt")
    manager = CheckpointManager(root / "ours", keep=3, log=lambda _m: None)
    (root / "plain").mkdir(parents=True)
    sizes = {}

    def timed(name: str, save) -> float:
        os.sync()
        started = time.perf_counter()
        nbytes = save()
        seconds = time.perf_counter() - started
        sizes[name] = nbytes
        return nbytes / 1e6 / seconds

    def ours(n: int) -> float:
        def save() -> int:
            path = manager.save(1000 + n, state, {"reason": "bench"})
            return sum(p.stat().st_size for p in path.iterdir() if p.name != "manifest.json")
        return timed("ours", save)

    def bare(n: int) -> float:
        path = root / "plain" / f"bare-{n}.pt"

        def save() -> int:
            torch.save(state, path)
            return path.stat().st_size
        rate = timed("bare", save)
        path.unlink()
        return rate

    def raw(n: int) -> float:
        path = root / "plain" / f"raw-{n}.pt"

        def save() -> int:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            with open(path, "wb") as fh:
                fh.write(buffer.getbuffer())
                fh.flush()
                os.fsync(fh.fileno())
            return path.stat().st_size
        rate = timed("raw", save)
        path.unlink()
        return rate

    repeats = max(ws.s.repeats, 3)
    say(f"checkpoint save, {ws.s.ckpt_model} weights + SGD momentum: {repeats} repeats")
    runs = interleaved({"ours (crash-safe)": ours, "torch.save, no fsync": bare, "BytesIO + write + fsync": raw},
                       repeats, "MB/s")
    sha = []
    for _ in range(3):
        started = time.perf_counter()
        state_sha256(state["model.pt"])
        sha.append(time.perf_counter() - started)
    shutil.rmtree(root, ignore_errors=True)
    extra = {"bytes": sizes, "model": ws.s.ckpt_model, "trainer_state_sha256_s": statistics.median(sha),
             "async_save": "see the async_checkpoint section: periodic saves write in the background"}
    mb = sizes["ours"] / 1e6
    return [
        compare(SECTION, f"checkpoint save vs one fsync'd write ({mb:,.0f} MB)", "MB/s",
                ours="crash-safe save (temp, fsync, manifest, rename)", ours_samples=runs["ours (crash-safe)"],
                baseline="torch.save to BytesIO + write + 1 fsync", baseline_samples=runs["BytesIO + write + fsync"],
                target=Target(">=", 0.80), extra=extra, note=f"{ws.s.ckpt_model} weights + SGD momentum"),
        compare(SECTION, f"checkpoint save vs bare torch.save ({mb:,.0f} MB)", "MB/s",
                ours="crash-safe save", ours_samples=runs["ours (crash-safe)"],
                baseline="torch.save to a file, no fsync (not durable)",
                baseline_samples=runs["torch.save, no fsync"], note="for scale: the bare save is not durable"),
    ]
