"""hpc-ddp: put PyTorch DDP training on Slurm nodes x GPUs, with a correct environment on every rank.

The core is pure (spec, nodelist, distenv, render); side effects live at the edges (executors, runner,
procs). Importing this package does not import torch.
"""

__version__ = "0.1.0"

from .distenv import DistEnv, from_environ  # noqa: E402
from .errors import EnvError, HpcDdpError, SpecError, SubmitError, UserError  # noqa: E402
from .spec import JobSpec, Target  # noqa: E402

__all__ = [
    "__version__", "DistEnv", "from_environ", "JobSpec", "Target",
    "HpcDdpError", "UserError", "SpecError", "EnvError", "SubmitError",
]
