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
            (model(x.float().view(-1, 1)).sum() * run.loss_weight()).backward()  # uneven splits weight it
        opt.step()
        opt.zero_grad()
        time.sleep(float(os.environ.get("KEYS_STEP_S", "0")))  # slow enough to be preempted mid-run
        out.write(json.dumps({"epoch": epoch, "keys": seen}) + "\n")
        out.flush()
        if run.step(batches=accum):
            break
run.finish()
