"""A user script on hpc-ddp's Session API that crashes at a chosen step, for `hpc-ddp rerun`'s tests: a
checkpoint every 5 steps, and with --crash-at K a RuntimeError on every rank at step K naming the step, the
step it resumed from and the loss (the same digits only if the rerun replays the same numbers)."""

import argparse

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import hpc_ddp

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--crash-at", type=int)
args = parser.parse_args()

run = hpc_ddp.start(checkpoint_every_steps=5, async_checkpoint=False)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
run.track(model=model, optimizer=opt)
resumed_at = run.progress.step if run.resume() else None
for _ in run.epochs(1, batches_per_epoch=args.steps):
    for _ in range(run.progress.step, args.steps):
        data = torch.Generator().manual_seed(1000 * run.rank + run.progress.step)  # the same batch at a step
        x = torch.randn(8, 4, generator=data)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        run.step(loss)
        if run.progress.step == args.crash_at:
            raise RuntimeError(f"crash at step {run.progress.step} (resumed from step {resumed_at}, "
                               f"world size {run.world_size}, loss {loss.item():.6f})")
run.finish()
