"""Records every (epoch, index) this rank trains, one line per optimizer step, through the Session API: the
test of a resume on another world size (tests/e2e/test_elastic.py) compares them with an uninterrupted run."""
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


run = hpc_ddp.start()
if os.environ.get("KEYS_FSDP"):  # sharded (tests/e2e/test_sharded.py): FSDP2 on each layer and the model
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
else:
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if run.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
run.track(model=model, optimizer=opt)
BATCH = int(os.environ.get("KEYS_BATCH", "4"))
loader = run.loader(Indices(), batch_size=BATCH)
accum = run.accumulation(1, batch_size=BATCH)
run.resume()
out = open(os.path.join(sys.argv[1], f"keys-{os.environ['HPC_DDP_JOB_ID']}-{run.rank}.jsonl"), "a")
for epoch in run.epochs(2):
    batches = iter(loader)
    for _ in range(len(loader) // accum):  # the loader's length is what is left of the epoch
        seen = []
        for _ in range(accum):
            x = next(batches)
            seen += x.tolist()
            (model(x.float().view(-1, 1) / 200).mean() * run.loss_weight()).backward()  # a mean: loss_weight() is for one
        opt.step()
        opt.zero_grad()
        time.sleep(float(os.environ.get("KEYS_STEP_S", "0")))  # slow enough to be preempted mid-run
        out.write(json.dumps({"epoch": epoch, "keys": seen}) + "\n")
        out.flush()
        if run.step(batches=accum):
            break
if os.environ.get("KEYS_FSDP"):  # the sharded model's outputs, for `hpc-ddp export`'s file to match
    probe = model(torch.linspace(0, 1, 7).view(-1, 1)).detach()  # a collective: every rank's forward
    if run.rank == 0:
        with open(os.path.join(sys.argv[1], "probe.json"), "w") as f:
            json.dump(probe.view(-1).tolist(), f)
run.finish()
