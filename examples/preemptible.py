# Your own training loop, made preemption-safe with hpc-ddp's Session API: a complete script that runs as
# it is (it makes its own data). Preempted, timed out or `hpc-ddp preempt`ed, it checkpoints at the next
# step, exits 75, is requeued, and resumes exactly where it stopped.
#   hpc-ddp submit --nodes 2 --gpus 4 examples/preemptible.py
#   hpc-ddp submit --executor local --tasks-per-node 2 examples/preemptible.py     # here, on CPUs

import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import hpc_ddp

torch.manual_seed(0)  # the same data and initial weights on every rank and in every attempt
inputs = torch.randn(4096, 32)
train_set = TensorDataset(inputs, (inputs.sum(dim=1) > 0).long())
epochs = int(os.environ.get("EPOCHS", 3))

with hpc_ddp.start() as run:                       # ranks meet, process group, this rank's device
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
                .to(run.device), device_ids=run.device_ids)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = run.sampler(train_set, batch_size=64)   # DistributedSampler's order; resumes mid-epoch
    loader = DataLoader(train_set, batch_size=64, sampler=sampler)
    run.track(model=model, optimizer=opt)          # what a checkpoint holds (anything with state_dict)
    run.resume()                                   # the newest checkpoint that verifies, if there is one
    for epoch in run.epochs(epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(run.device)), y.to(run.device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.step(loss)                         # a stop agreed by all ranks: checkpoint, exit 75
    run.finish()                                   # the final checkpoint and a "finish" record
