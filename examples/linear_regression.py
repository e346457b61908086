# An article's env:// DDP example (linear regression), made preemption-safe with hpc_ddp. hpc_ddp.start()
# also picks this rank's own device (the original's 'cuda' put every rank of a node on GPU 0) and gloo on CPU.
#   hpc-ddp submit --nodes 2 --gpus 1 examples/linear_regression.py

import os

import hpc_ddp
import torch
import torch.nn as nn
import torch.optim as optim
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

# Initialize distributed training
run = hpc_ddp.start()
device = run.device
torch.manual_seed(0)  # the same data and initial weights in every attempt

# Define the model
model = nn.Linear(10, 1).to(device)

# Wrap the model with DistributedDataParallel
model = DDP(model, device_ids=run.device_ids)

# Define the loss function and optimizer
criterion = nn.MSELoss()
optimizer = optim.SGD(model.parameters(), lr=0.01)

# Generate dummy input data
input_data = torch.randn(100, 10).to(device)
target_data = torch.randn(100, 1).to(device)
run.track(model=model, optimizer=optimizer)
run.resume()  # after the data is drawn: the checkpoint's RNG state picks up where the run stopped

# Perform distributed training
for epoch in run.epochs(int(os.environ.get("EPOCHS", 5)), batches_per_epoch=1):
    output = model(input_data)
    loss = criterion(output, target_data)

    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    run.step(loss)

    print(f"Epoch {epoch+1}: Loss = {loss.item()}")

# The final checkpoint; leaving the process group is hpc_ddp's (at exit)
run.finish()
