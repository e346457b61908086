# examples/preemptible.py with a sharded model: FSDP2 (`fully_shard`) in place of DDP. Each rank holds
# 1/N of the weights, gradients and AdamW state; at a checkpoint every rank writes its shards (DCP), and a
# resume loads them, on this number of ranks or (with --nodes MIN-MAX) on another.
#   hpc-ddp submit --nodes 4 --gpus 8 examples/fsdp_preemptible.py
#   hpc-ddp submit --executor local --tasks-per-node 2 examples/fsdp_preemptible.py     # here, on CPUs

import os

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import hpc_ddp

torch.manual_seed(0)  # the same data and initial weights on every rank and in every attempt
inputs = torch.randn(4096, 32)
train_set = TensorDataset(inputs, (inputs.sum(dim=1) > 0).long())
epochs = int(os.environ.get("EPOCHS", 3))

with hpc_ddp.start() as run:                       # ranks meet, process group, this rank's device
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2)).to(run.device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)                     # each block its own shard group
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
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
