"""An unmodified Lightning Trainer script that shards its model with FSDP2 on CPU (nothing of hpc_ddp).

Lightning's `FSDPStrategy` refuses CPU ("The strategy `fsdp` requires a GPU accelerator", Lightning 2.6,
lightning/pytorch/trainer/connectors/accelerator_connector.py, `_check_strategy_and_fallback`); its
`ModelParallelStrategy` runs FSDP2 (`fully_shard` in `configure_model`) on CPU over gloo. Every parameter
is a DTensor sharded over the data-parallel mesh (each rank holds 1/world of it; the script checks that),
and Lightning's own checkpoint is a distributed checkpoint (one shard file per rank):
ModelCheckpoint(save_last=True, every_n_train_steps=5) and trainer.fit(..., ckpt_path="last").

Usage: python lightning_model_parallel.py [OUT]  (OUT defaults to ./fsdp-out; the checkpoints go to OUT/ckpt)
"""

import os
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

out = sys.argv[1] if len(sys.argv) > 1 else "fsdp-out"
os.makedirs(out, exist_ok=True)
STEPS = int(os.environ.get("FSDP_STEPS", "60"))
attempt = os.environ.get("HPC_DDP_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_train_start(self):
        # FSDP for real: each rank holds its own 1/world of every weight, not a replica
        weight = self.net[0].weight
        local = tuple(weight.to_local().shape)
        assert local == (32 // world, 8), local
        with open(os.path.join(out, f"sharded-{self.global_rank}.txt"), "w") as fh:
            fh.write(f"{type(weight).__name__} {weight.placements} local {local} of {tuple(weight.shape)}\n")

    def training_step(self, batch, _index):
        time.sleep(0.2)
        with open(os.path.join(out, f"steps-{self.global_rank}.txt"), "a") as fh:
            fh.write(f"{attempt} {self.global_step}\n")
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = TensorDataset(torch.randn(8 * STEPS * world, 8), torch.randn(8 * STEPS * world, 1))
trainer = L.Trainer(
    accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
    num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", "1")),
    strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
    max_steps=STEPS, enable_progress_bar=False, logger=False, enable_model_summary=False,
    callbacks=[ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), save_last=True, every_n_train_steps=5)])
trainer.fit(Model(), DataLoader(data, batch_size=8), ckpt_path="last")
with open(os.path.join(out, f"done-{trainer.global_rank}.txt"), "w") as fh:
    fh.write(str(trainer.global_step))
