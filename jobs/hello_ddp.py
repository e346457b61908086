"""A minimal DDP training script, written for torchrun (env:// rendezvous) with no hpc-ddp import.

    hpc-ddp submit --nodes 2 --gpus 4 jobs/hello_ddp.py -- --steps 200
    torchrun --nproc-per-node 2 jobs/hello_ddp.py       # the same script, without hpc-ddp

Fits y = 3x + 1 with a one-neuron model; every rank sees its own data and DDP averages the gradients.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=float(os.environ.get("LR", 0.1)))
    args = parser.parse_args()

    dist.init_process_group(os.environ.get("BACKEND", "gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # torchrun's and hpc-ddp's: this rank's GPU on its node
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = DDP(torch.nn.Linear(1, 1).to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    for step in range(1, args.steps + 1):
        x = torch.rand(64, 1, generator=gen).to(device)
        loss = torch.nn.functional.mse_loss(model(x), 3 * x + 1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 25 == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss.item():.5f}", flush=True)
    w, b = model.module.weight.item(), model.module.bias.item()
    print(f"rank {rank}/{world} on {os.environ.get('HPC_DDP_HOSTS', '?').split(',')[int(os.environ.get('NODE_RANK', 0))]}:"
          f" learned y = {w:.3f}x + {b:.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
