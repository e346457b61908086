"""How a job that Slurm runs is watched and managed, for the executors that hand jobs to Slurm (sbatch,
submitit): squeue, then sacct, then scontrol to ask (`launch.status.scheduler_state`); scancel to act.
"""

from __future__ import annotations

from typing import Any

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.events import JsonLines
from hpc_ddp.common.procs import CommandRunner
from hpc_ddp.launch.executors.base import Run

__all__ = ["SlurmControl"]


class SlurmControl:
    """The state/cancel/signal half of an executor whose jobs are Slurm jobs."""

    queues = True
    commands: CommandRunner

    def state(self, run: Run) -> dict[str, Any]:
        from hpc_ddp.launch.status import scheduler_state

        if not run.job_id or not self.commands.which("squeue"):
            return {}
        return scheduler_state(run.job_id, self.commands)

    def cancel(self, run: Run) -> str:
        self._scancel([_job(run)])
        JsonLines(run.paths.events).write({"event": "cancelled", "job_id": run.job_id, "by": "hpc-ddp cancel"})
        return f"Cancelled job {run.job_id} ({run.run_dir})"

    def signal(self, run: Run, name: str) -> None:
        self._scancel(["--signal", name, _job(run)])

    def _scancel(self, args: list[str]) -> None:
        done = self.commands.run(["scancel", *args], timeout=30)
        if done.returncode != 0:
            raise UserError(f"scancel {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")


def _job(run: Run) -> str:
    if not run.job_id:
        raise UserError(f"{run.run_dir} records no Slurm job id (it was never submitted)",
                        hint="`hpc-ddp list` shows the submitted runs")
    return run.job_id
