"""A resume on another world size at `nodes` x `per_node` ranks (issue 32): the position arithmetic and
the sampler of one rank, for an ImageNet-sized epoch (1,281,167 samples) stopped halfway by a run on twice
as many ranks, resumed keeping the global batch.

Measured: `data.elastic.resize` (every rank does it once), the sampler's share of one rank (the epoch's
permutation and its slice: what each rank computes when its epoch starts), and a check that the ranks'
shares from the resumed position cover the rest of the epoch's whole global batches exactly once (as
index ranges: the arithmetic itself, for every rank).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hpc_ddp.data.elastic import epoch_samples, rank_share, resize
from hpc_ddp.data.loaders import ResumableSampler

SAMPLES, BATCH = 1_281_167, 32


def run(nodes: int, per_node: int) -> dict:
    world, saved = nodes * per_node, 2 * nodes * per_node
    global_batch = BATCH * saved                       # the saved run's, accumulation 1
    steps_done = epoch_samples(SAMPLES, global_batch) // global_batch // 2
    t0 = time.perf_counter()
    moved = resize(saved_world=saved, world=world, batch_size=BATCH, grad_accum=1, batch_in_epoch=steps_done,
                   policy="keep_global_batch")
    resize_us = (time.perf_counter() - t0) * 1e6
    consumed = moved.batch_in_epoch * BATCH * world
    t0 = time.perf_counter()
    sampler = ResumableSampler(SAMPLES, rank=world - 1, world_size=world, seed=0, keys=False)
    sampler.set_position(3, moved.batch_in_epoch * BATCH)
    share = list(sampler)
    sampler_ms = (time.perf_counter() - t0) * 1e3
    end = epoch_samples(SAMPLES, moved.global_batch)
    steps_left = (end - consumed) // moved.global_batch
    per_rank = steps_left * moved.grad_accum * BATCH   # what each rank trains of its share
    t0 = time.perf_counter()
    covered = 0
    for rank in range(world):
        positions = rank_share(SAMPLES, consumed, rank, world)[:per_rank]
        assert positions.start == consumed + rank and positions.step == world and len(positions) == per_rank
        covered += len(positions)
    check_ms = (time.perf_counter() - t0) * 1e3
    assert covered == end - consumed and len(share) >= per_rank
    return {"world": world, "saved_world": saved, "grad_accum": moved.grad_accum, "resize_us": round(resize_us, 2),
            "sampler_ms_per_rank": round(sampler_ms, 1), "check_ms_all_ranks": round(check_ms, 2),
            "samples_left": end - consumed, "exact": True}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(json.dumps(run(args.nodes, args.per_node)))


if __name__ == "__main__":
    main()
