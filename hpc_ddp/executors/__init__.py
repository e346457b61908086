"""Executors: how a planned job is started. Each is a small class behind one protocol (`base.Executor`):
`plan(spec, run_dir)` is pure and is what `--dry-run` shows; `submit(plan)` is the side effect.
Executors load lazily, so planning an sbatch job never imports submitit or torch.
"""

from __future__ import annotations

from .base import Executor, Plan, Submission

__all__ = ["Executor", "Plan", "Submission", "get_executor", "choose_executor", "NAMES"]

NAMES = ("sbatch", "submitit", "local")


def choose_executor(requested: str | None, sbatch_found: bool) -> tuple[str, str]:
    """(name, why): the requested executor, or sbatch where Slurm's commands exist, else local."""
    if requested:
        return requested, "as requested"
    if sbatch_found:
        return "sbatch", "Slurm's sbatch was found"
    return "local", "no sbatch on PATH, running on this machine"


def get_executor(name: str, **kwargs) -> Executor:
    if name == "sbatch":
        from .sbatch import SbatchExecutor
        return SbatchExecutor(**kwargs)
    if name == "submitit":
        from .submitit_exec import SubmititExecutor
        return SubmititExecutor(**kwargs)
    if name == "local":
        from .local import LocalExecutor
        return LocalExecutor(**kwargs)
    raise ValueError(f"unknown executor {name!r}")
