"""An unmodified accelerate loop that asks for FSDP2 (FullyShardedDataParallelPlugin(fsdp_version=2)), with
accelerate's own checkpoints: save_state every 5 steps, load_state at start when a state was saved.

On CPU accelerate does not run FSDP: accelerate 1.15 picks DistributedType.FSDP only inside its branch for
accelerator devices (accelerate/state.py, AcceleratorState.__init__: `elif self.distributed_type in
[DistributedType.MULTI_GPU, ...]`, which MULTI_CPU is not in), so on CPU the plugin is dropped without a
word and prepare() wraps the model in DistributedDataParallel; `accelerate launch --cpu --use_fsdp`
refuses outright ("You can only use one of `--cpu`, `--multi_gpu`, `--tpu`, `--use_deepspeed`,
`--use_fsdp` at a time.", accelerate/commands/launch.py, _validate_launch_command). Each rank writes what
it got to OUT/mode-RANK.json (distributed type, the model's wrapper, whether its weight is a sharded
DTensor), so a test records that fallback, and would notice the day accelerate shards on CPU.

Usage: python accelerate_fsdp.py [OUT]  (OUT defaults to ./fsdp-out; the state goes to OUT/state)
"""

import json
import os
import sys
import time

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

out = sys.argv[1] if len(sys.argv) > 1 else "fsdp-out"
os.makedirs(out, exist_ok=True)
STEPS = int(os.environ.get("FSDP_STEPS", "60"))
attempt = os.environ.get("HPC_DDP_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", "0"))
state = os.path.join(out, "state")

# without cpu=True, accelerate on a machine with no GPU makes each rank a world of its own (num_processes 1)
accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                          fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = accelerator.prepare(model, opt)
weight = next(model.parameters())
local = weight.to_local().shape if hasattr(weight, "to_local") else weight.shape
with open(os.path.join(out, f"mode-{accelerator.process_index}.json"), "w") as fh:
    json.dump({"distributed_type": str(accelerator.distributed_type), "num_processes": accelerator.num_processes,
               "is_fsdp2": accelerator.is_fsdp2, "wrapper": type(model).__name__,
               "weight": type(weight).__name__, "local_shape": list(local), "shape": list(weight.shape)}, fh)
start = 0
if os.path.exists(os.path.join(state, "step.txt")):
    accelerator.load_state(state)
    with open(os.path.join(state, "step.txt")) as fh:
        start = int(fh.read())
for step in range(start, STEPS):
    g = torch.Generator().manual_seed(step * accelerator.num_processes + accelerator.process_index)
    loss = torch.nn.functional.mse_loss(model(torch.randn(8, 8, generator=g)), torch.randn(8, 1, generator=g))
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    time.sleep(0.2)
    with open(os.path.join(out, f"steps-{accelerator.process_index}.txt"), "a") as fh:
        fh.write(f"{attempt} {step}\n")
    if (step + 1) % 5 == 0:
        accelerator.save_state(state)
        if accelerator.is_main_process:
            with open(os.path.join(state, "step.txt"), "w") as fh:
                fh.write(str(step + 1))
        accelerator.wait_for_everyone()
if accelerator.is_main_process:
    with open(os.path.join(out, "done.txt"), "w") as fh:
        fh.write(str(STEPS))
