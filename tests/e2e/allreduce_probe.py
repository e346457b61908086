"""A plain torchrun-style DDP script (env:// rendezvous) used by the end-to-end tests.

Every rank joins the process group, all-reduces its rank number, and writes what it saw to
$WORKSPACE/probe/rank-N.json. Written the way a user would, with no hpc-ddp import.
"""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group(os.environ.get("BACKEND", "gloo"), timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    out = Path(os.environ["WORKSPACE"]) / "probe"
    out.mkdir(exist_ok=True)
    seen = {
        "rank": rank, "world_size": world, "all_reduce": total.item(), "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        **{k: os.environ.get(k) for k in (
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
            "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "SLURMD_NODENAME", "BACKEND",
            "WORKER_PER_NODE", "EPOCHS", "LR", "BATCH_SIZE", "HPC_DDP_JOB_ID", "HPC_DDP_HOSTS",
            "HPC_DDP_CUDA_DEVICE", "HPC_DDP_GPU_BINDING")},
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}/{world}: all_reduce={total.item()}")


if __name__ == "__main__":
    main()
