"""An unmodified Lightning Fabric loop that shards its model with FSDP2 on CPU (nothing of hpc_ddp).

Fabric's `FSDPStrategy` refuses CPU ("You selected the FSDP strategy but FSDP is only available on GPU",
Lightning 2.6, lightning/fabric/connector.py, `_check_strategy_and_fallback`); its `ModelParallelStrategy`
runs FSDP2 (`fully_shard` in the parallelize function) on CPU over gloo. Every parameter is a DTensor
sharded over the data-parallel mesh (the script checks each rank holds 1/world of it). Fabric's own
checkpoint is a distributed checkpoint (a folder, one shard file per rank): fabric.save every 5 steps into
a new folder OUT/ckpt/step-N (rank 0 then marks it complete: OUT/ckpt/step-N.done), and fabric.load of the
newest complete one at start. A rank killed while saving leaves at most an unmarked newest folder, skipped.

Usage: python fabric_model_parallel.py [OUT]  (OUT defaults to ./fsdp-out)
"""

import os
import shutil
import sys
import time

import lightning as L
import torch
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

out = sys.argv[1] if len(sys.argv) > 1 else "fsdp-out"
os.makedirs(out, exist_ok=True)
STEPS = int(os.environ.get("FSDP_STEPS", "60"))
attempt = os.environ.get("HPC_DDP_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
ckpts = os.path.join(out, "ckpt")


def parallelize(model, mesh):
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def newest_complete():
    done = [int(d[len("step-"):-len(".done")]) for d in os.listdir(ckpts) if d.startswith("step-")
            and d.endswith(".done")] if os.path.isdir(ckpts) else []
    return max(done) if done else None


fabric = L.Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                  num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
                  strategy=ModelParallelStrategy(parallelize, data_parallel_size=world, tensor_parallel_size=1))
fabric.launch()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
model = fabric.setup_module(model)
opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
weight = model.module[0].weight
local = tuple(weight.to_local().shape)
assert local == (32 // world, 8), local  # FSDP for real: each rank holds its own 1/world of every weight
with open(os.path.join(out, f"sharded-{fabric.global_rank}.txt"), "w") as fh:
    fh.write(f"{type(weight).__name__} {weight.placements} local {local} of {tuple(weight.shape)}\n")

state = {"model": model, "optimizer": opt, "step": 0}
newest = fabric.broadcast(newest_complete())  # every rank loads the same one
if newest is not None:
    fabric.load(os.path.join(ckpts, f"step-{newest}"), state)
    assert state["step"] == newest, (state["step"], newest)
for step in range(state["step"], STEPS):
    g = torch.Generator().manual_seed(step * world + fabric.global_rank)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
    time.sleep(0.2)
    with open(os.path.join(out, f"steps-{fabric.global_rank}.txt"), "a") as fh:
        fh.write(f"{attempt} {step}\n")
    if (step + 1) % 5 == 0:
        state["step"] = step + 1
        fabric.save(os.path.join(ckpts, f"step-{step + 1}"), state)
        fabric.barrier()  # every rank's shard is written
        if fabric.global_rank == 0:
            open(os.path.join(ckpts, f"step-{step + 1}.done"), "w").close()
            for old in range(0, step + 1 - 5, 5):  # keep the newest two
                if os.path.exists(os.path.join(ckpts, f"step-{old}.done")):
                    os.remove(os.path.join(ckpts, f"step-{old}.done"))
                shutil.rmtree(os.path.join(ckpts, f"step-{old}"), ignore_errors=True)
if fabric.global_rank == 0:
    with open(os.path.join(out, "done.txt"), "w") as fh:
        fh.write(str(STEPS))
