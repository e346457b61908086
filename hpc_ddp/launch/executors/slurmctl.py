"""How a job that Slurm runs is watched and managed, for the executors that hand jobs to Slurm (sbatch,
submitit): squeue, then sacct, then scontrol to ask (`slurm.jobstate.scheduler_state`); scancel to act.
"""

from __future__ import annotations

import re
from typing import Any

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.events import JsonLines
from hpc_ddp.common.procs import CommandRunner
from hpc_ddp.launch.executors.base import Run
from hpc_ddp.slurm.jobstate import scheduler_state

__all__ = ["SlurmControl", "still_queued"]


def still_queued(jobs: list[str], commands: CommandRunner) -> list[str]:
    """Those of `jobs` squeue still lists (pending or running); ended ones are left alone."""
    if not jobs:
        return []
    done = commands.run(["squeue", "-h", "-o", "%i", "-j", ",".join(jobs)], timeout=30)
    listed = set(done.stdout.split()) if done.returncode == 0 else set()
    return [j for j in jobs if j in listed]


class SlurmControl:
    """The state/cancel/signal half of an executor whose jobs are Slurm jobs."""

    queues = True
    commands: CommandRunner

    def state(self, run: Run) -> dict[str, Any]:
        if not run.job_id or not self.commands.which("squeue"):
            return {}
        return scheduler_state(run.job_id, self.commands)

    def cancel(self, run: Run) -> str:
        """The run's job, and every later job of the run still queued (the rest of a --chain, a job the
        requeue fallback queued): cancelling a run must not leave its next job to start tomorrow."""
        job = _job(run)
        later = self.still_queued([j for j in run.paths.job_ids() if j != job])
        self._scancel([job, *later])
        events = JsonLines(run.paths.events)
        for cancelled in (job, *later):
            events.write({"event": "cancelled", "job_id": cancelled, "by": "hpc-ddp cancel"})
        also = f" and its queued job(s) {', '.join(later)}" if later else ""
        return f"Cancelled job {job}{also} ({run.run_dir})"

    def still_queued(self, jobs: list[str]) -> list[str]:
        """Those of `jobs` squeue still lists (pending or running); ended ones are left alone."""
        return still_queued(jobs, self.commands)

    def cancel_jobs(self, job_ids: list[str], runs: list[Run]) -> str:
        """Several jobs in one scancel (a sweep's queued tasks, whichever array or fallback queued them);
        each cancel is recorded in the run dir of `runs` that holds the job."""
        self._scancel(job_ids)
        for run in runs:
            mine = [job for job in run.paths.job_ids() if job in job_ids]
            for job in mine:
                JsonLines(run.paths.events).write({"event": "cancelled", "job_id": job, "by": "hpc-ddp cancel"})
        return f"Cancelled job(s) {', '.join(job_ids)}"

    def signal(self, run: Run, name: str) -> None:
        self._scancel(["--signal", name, _job(run)])

    def end_steps(self, run: Run) -> list[str]:
        """Cancel the job's running steps (the ranks', a guard's), never the job or its batch script, which
        then records how the attempt ended and requeues it. `scancel --signal KILL JOB` would cancel the whole
        job (Slurm treats SIGKILL so, measured on 22.05); a step id is cancelled on its own."""
        job = _job(run)
        listed = self.commands.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], timeout=30)
        steps = [s for s in listed.stdout.split() if re.fullmatch(rf"{re.escape(job)}\.\d+", s)] \
            if listed.returncode == 0 else []
        if steps:
            self._scancel(steps)
        return steps

    def signal_jobs(self, job_ids: list[str], name: str) -> None:
        """Several jobs (a sweep's running tasks) in one scancel. Only running ones: scancel --signal waits
        about 30 s for a pending job (an array's waiting tasks) before it gives up on it."""
        self._scancel(["--signal", name, *job_ids])

    def _scancel(self, args: list[str]) -> None:
        done = self.commands.run(["scancel", *args], timeout=30)
        if done.returncode != 0:
            raise UserError(f"scancel {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")


def _job(run: Run) -> str:
    if not run.job_id:
        raise UserError(f"{run.run_dir} records no Slurm job id (it was never submitted)",
                        hint="`hpc-ddp list` shows the submitted runs")
    return run.job_id
