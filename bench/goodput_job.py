"""The job of the goodput bench (bench/goodput_bench.py), in its two forms, each on every rank:

    python goodput_job.py hpc   OUT STEPS STEP_S CKPT_EVERY     the Session API (hpc-ddp submit): a checkpoint
                                                                 every CKPT_EVERY steps, resumed by hpc-ddp
    python goodput_job.py plain OUT STEPS STEP_S EPOCH_STEPS     what users write by hand (sbatch --requeue +
                                                                 srun): torch.distributed from Slurm's variables,
                                                                 torch.save every epoch, resume from the last file

The same work either way: STEPS optimizer steps of a small DDP model, each padded to STEP_S seconds (so 4
ranks on a shared 2-core machine measure the schedule, not CPU contention). Rank 0 appends one line per
step to OUT/steps.jsonl: the time, the step, the life (job id, attempt, srun step) and the nodes, from which
the bench counts the steps kept and the time they took.
"""

import json
import os
import sys
import time

import torch

mode, out, steps, step_s, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
life = [os.environ.get("SLURM_JOB_ID", "0"), int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        int(os.environ.get("SLURM_STEP_ID", "0"))]
nodes = int(os.environ.get("SLURM_STEP_NUM_NODES", os.environ.get("SLURM_NNODES", "1")))
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.01)


def log(rank, step):
    if rank == 0:
        with open(os.path.join(out, "steps.jsonl"), "a") as fh:
            fh.write(json.dumps({"t": time.time(), "step": step, "life": life, "nodes": nodes}) + "\n")


def one_step(model, accum=1, weight=1.0, batch=32):
    began = time.monotonic()
    opt.zero_grad()
    for _ in range(accum):
        (model(torch.randn(batch, 64)).pow(2).mean() * weight).backward()
    opt.step()
    time.sleep(max(step_s - (time.monotonic() - began), 0.0))


if mode == "hpc":
    import hpc_ddp

    run = hpc_ddp.start(checkpoint_every_steps=every, async_checkpoint=False, log_every=10)
    model = torch.nn.parallel.DistributedDataParallel(net) if run.distributed else net
    run.track(model=model, optimizer=opt)
    accum = run.accumulation(1, batch_size=32)  # a resume on another number of ranks keeps the global batch
    run.batch_size()                            # asked before the resume, as an uneven one requires
    run.resume()
    batch = run.batch_size()                    # uneven on 3 ranks: this rank's share of the global batch
    # One epoch longer than the run: the epoch counts batches, and a resume on fewer ranks takes more a step.
    for _ in run.epochs(1, batches_per_epoch=steps * 8):
        for _ in range(run.progress.step, steps):
            one_step(model, accum, run.loss_weight(), batch)
            log(run.rank, run.progress.step + 1)
            if run.step(batches=accum):
                break
    run.finish()
else:
    import torch.distributed as dist

    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(net)
    path = os.path.join(out, "ckpt.pt")
    start = 0
    if os.path.exists(path):
        state = torch.load(path)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    for step in range(start, steps):
        one_step(model)
        log(rank, step + 1)
        if (step + 1) % every == 0 and rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1}, path + ".tmp")
            os.replace(path + ".tmp", path)
    dist.destroy_process_group()
