"""Sharded models (FSDP2) against DDP, and sharded checkpoints against plain writes, on this machine's CPUs.

One spawned job per world size (gloo, 2 and 4 ranks) builds the same GPT-style decoder (trainer.models.GPT)
twice, under DDP and sharded with `fully_shard` on each block (trainer.sharded.shard_model), takes AdamW
steps on random tokens, and measures on every rank:
- memory: the weights, gradients and optimizer state this rank holds (trainer.sharded.state_bytes), FSDP
  over DDP (target <= 0.60 at 2 ranks: the ideal is 0.5);
- step time, FSDP over DDP (reported; on CPU FSDP's all-gathers are not overlapped by a GPU's streams);
- at 2 ranks, the sharded checkpoint: what a background save blocks (host_copy of the shards, all the loop
  waits for) over a synchronous sharded save of the same state (trainer.sharded.save_sharded: DCP write,
  fsync, hashes, manifest, rename; target <= 0.10), and that save's throughput over `dd ... conv=fsync` of
  the same bytes on the same disk (reported).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import Row, Target, Workspace, compare, say

SECTION = "fsdp"
MODEL = {"vocab": 4096, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 384}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, steps: int, saves: int) -> None:
    import torch
    import torch.distributed as dist

    from hpc_ddp.trainer.checkpoint import CheckpointManager
    from hpc_ddp.trainer.models import GPT
    from hpc_ddp.trainer.sharded import Sharded, host_copy, save_sharded, shard_model, state_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    found: dict = {}
    for strategy in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model = GPT(**MODEL)
        model = shard_model(model) if strategy == "fsdp" else torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        times = []
        for i in range(steps):
            torch.manual_seed(100 + i * world + rank)
            x = torch.randint(0, MODEL["vocab"], (4, MODEL["block_size"]))
            started = time.perf_counter()
            torch.nn.functional.cross_entropy(model(x), x).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - started)
        module = model.module if strategy == "ddp" else model
        found[strategy] = {"bytes": state_bytes(module, opt), "step_s": statistics.median(times[2:] or times)}
        if strategy == "fsdp" and saves:
            states = Sharded({"model": model, "optimizer": opt})
            manager = CheckpointManager(Path(out) / "ckpt", keep=2, log=lambda _m: None)
            blocked, whole, sizes, state = [], [], [], None
            for n in range(saves):
                dist.barrier()
                os.sync()
                started = time.perf_counter()
                state = host_copy(states.state(), state)  # as Session does: the last copy's buffers again
                blocked.append(time.perf_counter() - started)
                dist.barrier()
                os.sync()
                started = time.perf_counter()
                path = save_sharded(manager, states, n + 1, {"session.pt": {"n": n}}, {}, rank, world, state=state)
                whole.append(time.perf_counter() - started)
                if rank == 0:
                    sizes.append(sum(p.stat().st_size for p in path.iterdir()))
            found["save"] = {"blocked_s": blocked, "sync_s": whole, "bytes": sizes}
    gathered = [None] * world
    dist.all_gather_object(gathered, found)
    if rank == 0:
        Path(out, "found.json").write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _job(ws: Workspace, world: int, steps: int, saves: int) -> list[dict]:
    out = ws.fresh(f"fsdp-{world}")
    out.mkdir(parents=True)
    code = ("import sys; sys.path.insert(0, %r); import torch.multiprocessing as mp; from bench.fsdp_bench import "
            "_worker; mp.spawn(_worker, args=(%d, %d, %r, %d, %d), nprocs=%d)"
            % (str(Path(__file__).resolve().parent.parent), world, _free_port(), str(out), steps, saves, world))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the {world}-rank FSDP job failed: {done.stderr.strip().splitlines()[-1:]}")
    found = json.loads((out / "found.json").read_text())
    if saves:
        _dd_into(out, found)
    shutil.rmtree(out / "ckpt", ignore_errors=True)
    return found


def _dd_into(out: Path, found: list[dict]) -> None:
    """The disk's own: `dd` of as many bytes as one checkpoint, with an fsync, on the same filesystem."""
    size = found[0]["save"]["bytes"][-1]
    rates = []
    for n in range(len(found[0]["save"]["sync_s"])):
        target = out / f"dd-{n}"
        os.sync()
        started = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={max(1, size >> 20)}", "conv=fsync"],
                       check=True, capture_output=True)
        rates.append((max(1, size >> 20) << 20) / 1e6 / (time.perf_counter() - started))
        target.unlink()
    found[0]["dd_mb_s"] = rates


def run(ws: Workspace) -> list[Row]:
    steps, saves = (6, 2) if ws.s.quick else (20, max(ws.s.repeats, 3))
    rows: list[Row] = []
    for world in (2, 4):
        say(f"fsdp: GPT {MODEL} under DDP and FSDP2 on {world} ranks, {steps} steps each"
            + (f", {saves} sharded saves" if world == 2 else ""))
        found = _job(ws, world, steps, saves if world == 2 else 0)
        ddp = [r["ddp"]["bytes"]["total"] for r in found]
        fsdp = [r["fsdp"]["bytes"]["total"] for r in found]
        rows.append(compare(SECTION, f"memory per rank, FSDP vs DDP, {world} ranks", "MB",
                            ours="FSDP2: weights, gradients, AdamW state held by one rank",
                            ours_samples=[max(fsdp) / 1e6], baseline="DDP: the same, a full copy on every rank",
                            baseline_samples=[max(ddp) / 1e6],
                            target=Target("<=", 0.60) if world == 2 else None,
                            extra={"model": MODEL, "per_rank_fsdp_bytes": fsdp, "per_rank_ddp_bytes": ddp},
                            note="the largest rank's share; the ideal is 1/ranks"))
        rows.append(compare(SECTION, f"step time, FSDP vs DDP, {world} ranks (CPU)", "s",
                            ours="FSDP2 step (all-gather per block, reduce-scatter)",
                            ours_samples=[r["fsdp"]["step_s"] for r in found], baseline="DDP step (one all-reduce)",
                            baseline_samples=[r["ddp"]["step_s"] for r in found],
                            note="reported, no target: on CPUs nothing overlaps FSDP's collectives"))
        if world == 2:
            save = found[0]["save"]
            rows.append(compare(SECTION, "sharded save: what a background save blocks vs a synchronous one", "s",
                                ours="host copy of every rank's shards (the loop waits for this only)",
                                ours_samples=save["blocked_s"], baseline="synchronous sharded save (DCP, fsync, "
                                "hashes, manifest, rename)", baseline_samples=save["sync_s"],
                                target=Target("<=", 0.10), extra={"bytes": save["bytes"][-1]}))
            mb = save["bytes"][-1] / 1e6
            rows.append(compare(SECTION, f"sharded save throughput vs dd with fsync ({mb:,.0f} MB)", "MB/s",
                                ours="synchronous sharded save, 2 ranks writing",
                                ours_samples=[mb / s for s in save["sync_s"]],
                                baseline="dd if=/dev/zero bs=1M conv=fsync, the same bytes",
                                baseline_samples=found[0]["dd_mb_s"], note="reported"))
    return rows

