"""hpc-ddp: put PyTorch DDP training on Slurm nodes x GPUs, with a correct environment on every rank.

The public API for a training loop of your own (`hpc_ddp.trainer.session`, loaded on first use):

    start(run_dir=None, **settings) -> Session   this rank joins the run (see session.py)
    Session          track / resume / sampler / epochs / step / save / requeue / finish / log_metrics
    Progress         step, epoch, batch_in_epoch, restarts, samples
    ResumableSampler DistributedSampler's order, started at any batch of any epoch
    CheckpointManager, capture_rng, restore_rng   the pieces Session is made of
    REQUEUE_EXIT_CODE                             75: "checkpointed, requeue me"
    UsageError, IncompatibleResume, Diverged      what misuse and a diverged loss raise

The core is pure (spec, nodelist, distenv, render); side effects live at the edges (executors, runner,
procs). Importing this package does not import torch: the API names above load it when first used.
"""

__version__ = "0.1.0"

from hpc_ddp.common.errors import EnvError, HpcDdpError, SpecError, SubmitError, UserError  # noqa: E402
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE  # noqa: E402
from hpc_ddp.job.distenv import DistEnv, from_environ  # noqa: E402
from hpc_ddp.spec.jobspec import JobSpec, Target  # noqa: E402

# name -> module that defines it; imported on first access (PEP 562), so the CLI stays torch-free.
_LAZY = {
    "start": "trainer.session", "Session": "trainer.session", "Progress": "trainer.session",
    "UsageError": "trainer.session", "IncompatibleResume": "trainer.session", "Diverged": "trainer.session",
    "ResumableSampler": "data.loaders", "CheckpointManager": "trainer.checkpoint",
    "CheckpointError": "trainer.checkpoint", "capture_rng": "trainer.rngstate", "restore_rng": "trainer.rngstate",
}

__all__ = [
    "__version__", "DistEnv", "from_environ", "JobSpec", "Target", "REQUEUE_EXIT_CODE",
    "HpcDdpError", "UserError", "SpecError", "EnvError", "SubmitError", *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpc_ddp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
