"""The baseline for `make bench`: the usual hand-written DDP loop, with the same model, data, batch size
and loader settings as the trainer's job, and nothing else (no checkpoints, no agreement collective,
no per-sample seeding). Started the same way (by the local executor), so only the loop differs.

    python bench/plain_ddp.py DATA_DIR STEPS BATCH WORKERS OUT.json
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torchvision.datasets as D
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from hpc_ddp.models import SmallCNN


def main() -> None:
    data_dir, steps, batch, workers, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    transform = T.Compose([T.RandomCrop(28, padding=3), T.ToTensor(), T.Normalize((0.5,), (0.5,))])
    data = D.MNIST(data_dir, train=True, download=False, transform=transform)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True, num_workers=workers,
                        persistent_workers=workers > 0)
    model = DDP(SmallCNN(1, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    done, epoch, marks = 0, 0, []
    while done < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            marks.append(time.monotonic())
            if done >= steps:
                break
        epoch += 1
    if rank == 0:
        warm = 10  # skip start-up and the first loader fill, as for the trainer
        rate = (steps - warm) * batch * world / (marks[-1] - marks[warm - 1])
        with open(out, "w") as fh:
            json.dump({"samples_per_s": rate, "loss": loss.item()}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
