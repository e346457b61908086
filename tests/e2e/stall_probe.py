"""A rank that stops making progress (SIGSTOP at step 20, or with STALL_HOW=wait a wait that never ends: a
deadlock, which a process of its own can watch) while staying alive: tests/e2e/test_stall.py."""
import os
import signal
import threading
import time

import torch

import hpc_ddp

run = hpc_ddp.start()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
run.track(model=model, optimizer=opt)
run.resume()
for step in range(10_000):
    if run.rank == int(os.environ.get("STALL_RANK", "1")) and step == 20:
        if os.environ.get("STALL_HOW") == "wait":
            threading.Event().wait()           # a deadlock: the process runs, its loop does not
        os.kill(os.getpid(), signal.SIGSTOP)   # alive, but making no progress
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.02)
    run.step()
run.finish()
