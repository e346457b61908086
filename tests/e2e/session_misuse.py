"""Session API misuse on several ranks (tests/e2e/test_session_rows.py), chosen by MISUSE:
save_alone: rank 0 alone calls run.save(), then every rank calls finish();
slow_step: rank 0 takes one 6 s step at step SLOW_AT of STEPS (with HPC_DDP_STALL_MIN_S=3: not a stall
once the run goes on, and never after finish())."""
import os
import time

import torch

import hpc_ddp

misuse = os.environ.get("MISUSE", "")
with hpc_ddp.start() as run:
    model = torch.nn.Linear(4, 1)
    if run.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run.track(model=model, optimizer=opt)
    run.resume()
    for step in range(int(os.environ.get("STEPS", "5"))):
        if misuse == "slow_step" and run.rank == 0 and step == int(os.environ.get("SLOW_AT", "150")):
            time.sleep(6)
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.02)
        run.step()
    if misuse == "save_alone" and run.rank == 0:
        run.save()
    run.finish()
