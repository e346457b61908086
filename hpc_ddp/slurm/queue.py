"""`sbatch` for a run dir's batch script: the one place that queues a job and reads its id back. Used on the
login node (the sbatch executor, --chain) and on a compute node (the requeue fallback, `job.chain`), so it
imports nothing of the launcher.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from hpc_ddp.common.errors import SubmitError, UserError
from hpc_ddp.common.procs import CommandRunner, slurm_unreachable
from hpc_ddp.common.rundir import SCRIPT

__all__ = ["SchedulerRefused", "sbatch"]


class SchedulerRefused(UserError):
    """sbatch refused the request (bad partition, account, limits...): nothing was queued."""


def sbatch(commands: CommandRunner, run_dir: str | Path, dependency: str | None = None,
           env: Mapping[str, str] | None = None) -> str:
    """Queue the run dir's script (from inside the run dir); its job id. A dependency given here overrides
    the script's own `#SBATCH --dependency` (command-line options win over directives)."""
    argv = ["sbatch", "--parsable", *([f"--dependency={dependency}"] if dependency else []), SCRIPT]
    done = commands.run(argv, cwd=str(run_dir), env=env)
    if done.returncode != 0:
        message = " ".join((done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}").splitlines())
        if slurm_unreachable(message):  # Slurm itself is down: not the user's mistake
            raise SubmitError(f"sbatch could not reach Slurm: {message}", hint="check `sinfo`; try again later")
        raise SchedulerRefused(f"sbatch refused the job: {message}")
    job_id = done.stdout.strip().split(";")[0]
    if not job_id:
        raise SubmitError(f"sbatch printed no job id (stdout {done.stdout!r})")
    return job_id
