"""The baseline for `make bench`: the usual hand-written DDP loop, with the same model, data, batch size
and loader settings as the trainer's job, and nothing else (no checkpoints, no agreement collective,
no per-sample seeding, no per-step loss.item()). Started either by the local executor (same launch path
as the trainer, so only the loop differs) or by torchrun (the start-up comparison).

    python bench/plain_ddp.py --data DIR|fake --steps N --batch B --workers W --out OUT.json [options]

Rank 0 writes OUT.json: samples/s between the end of step `--warm` and the last step (start-up, the
first loader fill and torch.compile's first steps excluded), and the wall-clock time at which the
first step finished (for the start-up comparison).
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torchvision.datasets as D
import torchvision.transforms as T
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from hpc_ddp.trainer.models import SmallCNN


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="an MNIST directory, `fake` (torchvision FakeData), or "
                                                 "imagefolder:DIR (DIR/train of JPEGs, as the seeds read ImageNet)")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--warm", type=int, default=10)
    p.add_argument("--model", default="cnn", choices=["cnn", "resnet50"])
    p.add_argument("--image-size", type=int, default=224, help="fake data only")
    p.add_argument("--num-classes", type=int, default=1000, help="fake data only")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--no-ddp", action="store_true", help="one process, no process group, no DDP wrapper")
    p.add_argument("--synthetic", action="store_true", help="one random batch kept on the device: no loader")
    return p.parse_args()


def dataset(a: argparse.Namespace):
    if a.data == "fake":  # what the trainer's `dataset = "fake"` reads
        tf = T.Compose([T.ToTensor(), T.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))])
        return D.FakeData(a.batch * (a.steps + 2), (3, a.image_size, a.image_size), a.num_classes, transform=tf)
    if a.data.startswith("imagefolder:"):  # the seeds' ImageNet loop: PIL decode, RandomResizedCrop, flip
        tf = T.Compose([T.RandomResizedCrop(a.image_size), T.RandomHorizontalFlip(), T.ToTensor(),
                        T.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))])
        return D.ImageFolder(os.path.join(a.data.removeprefix("imagefolder:"), "train"), transform=tf)
    tf = T.Compose([T.RandomCrop(28, padding=3), T.ToTensor(), T.Normalize((0.5,), (0.5,))])
    return D.MNIST(a.data, train=True, download=False, transform=tf)


def batches(a: argparse.Namespace, rank: int, world: int, device: torch.device):
    """(x, y) on the device, forever: the loader's epochs one after another, or one synthetic batch."""
    if a.synthetic:
        x = torch.randn(a.batch, 3, a.image_size, a.image_size, device=device)
        y = torch.randint(0, a.num_classes, (a.batch,), device=device)
        while True:
            yield x, y
    data = dataset(a)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=a.batch, sampler=sampler, drop_last=True, num_workers=a.workers,
                        persistent_workers=a.workers > 0, pin_memory=device.type == "cuda")
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for x, y in loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        epoch += 1


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    a = parse()
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    if not a.no_ddp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = (0, 1) if a.no_ddp else (dist.get_rank(), dist.get_world_size())
    torch.manual_seed(0)
    if a.model == "cnn":
        model = SmallCNN(1, 10).to(device)
    else:
        import torchvision.models as tvm

        model = tvm.resnet50(num_classes=a.num_classes).to(device)
    memory_format = torch.channels_last if a.channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    if a.compile:
        model.compile()
    if not a.no_ddp:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    first_step_time = start = None
    source = batches(a, rank, world, device)
    for step in range(1, a.steps + 1):
        x, y = next(source)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = torch.nn.functional.cross_entropy(model(x.contiguous(memory_format=memory_format)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 1:
            sync(device)
            first_step_time = time.time()
        if step == a.warm:
            sync(device)
            start = time.monotonic()
    sync(device)
    rate = (a.steps - a.warm) * a.batch * world / (time.monotonic() - start)
    if rank == 0:
        with open(a.out, "w") as fh:
            json.dump({"samples_per_s": rate, "first_step_time": first_step_time, "loss": loss.item()}, fh)
    if not a.no_ddp:
        dist.destroy_process_group()
    os._exit(0)  # persistent loader workers in a generator: leave without waiting on their shutdown


if __name__ == "__main__":
    main()
