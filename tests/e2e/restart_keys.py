"""elastic_keys.py for restarts inside the allocation (issue 44): every (epoch, index) a rank trains, one line
per optimizer step, tagged with the step and the life that trained it (attempt, srun step), so a test can
drop the steps a crash lost and a restart redid (`trained_once`). A checkpoint every KEYS_CHECKPOINT_EVERY
steps; KEYS_CRASH_AT=N:R makes rank R die (exit 3, no checkpoint) at step N, once per run dir; KEYS_FSDP=1
shards the model with FSDP2; KEYS_DEVICES=1 records the GPU each rank takes as its own, per life.
KEYS_BALLAST_MB=N adds N MB of state to every checkpoint and makes them background writes, so one is in
flight for a while; KEYS_CRASH_IN_WRITE=R makes rank R die (exit 3) the first time it sees rank 0's
unfinished save (a `.tmp-step-*` folder in the run's checkpoints) after one was committed, once per run
dir."""
import json
import os
import sys
import time

import torch

import hpc_ddp


class Indices(torch.utils.data.Dataset):
    def __len__(self):
        return 200

    def __getitem__(self, i):
        return torch.tensor(i)


ballast_mb = int(os.environ.get("KEYS_BALLAST_MB", "0"))
run = hpc_ddp.start(checkpoint_every_steps=int(os.environ.get("KEYS_CHECKPOINT_EVERY", "0")),
                    async_checkpoint=bool(ballast_mb))
if os.environ.get("KEYS_FSDP"):  # sharded: every rank checkpoints its shards, and a restart reshards them
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.Linear(8, 1))
    for part in (model[0], model[1], model):
        fully_shard(part)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
else:
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if run.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
run.track(model=model, optimizer=opt)
if ballast_mb:  # random, so no write is cheaper than its size; the same on every life (seeded)
    run.track(ballast={"bytes": torch.randn(ballast_mb << 18, generator=torch.Generator().manual_seed(0))})
loader = run.loader(Indices(), batch_size=4)
accum = run.accumulation(1, batch_size=4)
run.resume()
life = [int(os.environ.get("SLURM_RESTART_COUNT", "0")), int(os.environ.get("SLURM_STEP_ID", "0"))]
out = open(os.path.join(sys.argv[1], f"keys-{os.environ['HPC_DDP_JOB_ID']}-{life[0]}-{life[1]}-{run.rank}.jsonl"), "a")
if os.environ.get("KEYS_DEVICES"):  # the GPU this rank takes as its own, in this life (fake GPUs: GRES)
    from hpc_ddp.job.gpubind import entries, own_device

    visible = entries(os.environ.get("CUDA_VISIBLE_DEVICES"))
    with open(os.path.join(sys.argv[1], f"devices-{life[0]}-{life[1]}-{run.rank}.json"), "w") as fh:
        json.dump({"node": os.environ.get("SLURMD_NODENAME"), "local_rank": os.environ.get("LOCAL_RANK"),
                   "visible": visible, "own": visible[own_device(os.environ, len(visible))] if visible else None}, fh)
crash_at, _, crash_rank = os.environ.get("KEYS_CRASH_AT", "").partition(":")
marker = os.path.join(sys.argv[1], "crashed")
crash_in_write = os.environ.get("KEYS_CRASH_IN_WRITE")
checkpoints = os.path.join(os.environ.get("HPC_DDP_RUN_DIR", "."), "checkpoints")


def writing() -> bool:
    """A save in flight while an earlier one is committed (`latest`): the restart has one to resume from."""
    names = os.listdir(checkpoints) if os.path.isdir(checkpoints) else ()
    return "latest" in names and any(n.startswith(".tmp-step-") for n in names)

for epoch in run.epochs(2):
    batches = iter(loader)
    for _ in range(len(loader) // accum):  # the loader's length is what is left of the epoch
        seen = []
        for _ in range(accum):
            x = next(batches)
            seen += x.tolist()
            (model(x.float().view(-1, 1)).sum() * run.loss_weight()).backward()  # uneven splits weight it
        opt.step()
        opt.zero_grad()
        time.sleep(float(os.environ.get("KEYS_STEP_S", "0")))
        out.write(json.dumps({"epoch": epoch, "step": run.progress.step, "life": life, "keys": seen}) + "\n")
        out.flush()
        if crash_at == str(run.progress.step) and str(run.rank) == crash_rank and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(3)
        if crash_in_write == str(run.rank) and not os.path.exists(marker) and writing():
            open(marker, "w").write(json.dumps({"step": run.progress.step, "saw": sorted(os.listdir(checkpoints))}))
            os._exit(3)
        if run.step(batches=accum):
            break
run.finish()
