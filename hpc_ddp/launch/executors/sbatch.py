"""The sbatch executor: render the batch script into the run dir and hand it to `sbatch`."""

from __future__ import annotations

from pathlib import Path

from hpc_ddp.common.errors import SubmitError, UserError
from hpc_ddp.common.procs import CommandRunner, SubprocessCommands, slurm_unreachable
from hpc_ddp.common.rundir import SCRIPT, RunDir
from hpc_ddp.launch.executors.base import Plan, Submission, record_submission, write_run_dir
from hpc_ddp.launch.executors.slurmctl import SlurmControl
from hpc_ddp.launch.render import render_sbatch
from hpc_ddp.spec.jobspec import JobSpec


class SchedulerRefused(UserError):
    """sbatch refused the request (bad partition, account, limits...): nothing was queued."""


class SbatchExecutor(SlurmControl):
    name = "sbatch"

    def __init__(self, commands: CommandRunner | None = None, *, generated_at: str = "", command_line: str = ""):
        self.commands = commands or SubprocessCommands()
        self.generated_at = generated_at
        self.command_line = command_line

    def plan(self, spec: JobSpec, run_dir: str) -> Plan:
        script = render_sbatch(spec, run_dir, generated_at=self.generated_at, command_line=self.command_line)
        return Plan("sbatch", spec, run_dir, script, summary=script)

    def submit(self, plan: Plan, on_job_id=None) -> Submission:
        run_dir = write_run_dir(plan)
        script_path = RunDir(run_dir).script
        script_path.write_text(plan.script or "")
        script_path.chmod(0o700)
        # sbatch runs in the run dir: the script's relative log paths resolve there, on every requeue too.
        done = self.commands.run(["sbatch", "--parsable", SCRIPT], cwd=str(run_dir))
        if done.returncode != 0:
            message = " ".join((done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}").splitlines())
            if slurm_unreachable(message):  # Slurm itself is down: not the user's mistake
                raise SubmitError(f"sbatch could not reach Slurm: {message}", hint="check `sinfo`; try again later")
            raise SchedulerRefused(f"sbatch refused the job: {message}")
        job_id = done.stdout.strip().split(";")[0]
        if not job_id:
            raise SubmitError(f"sbatch printed no job id (stdout {done.stdout!r})")
        sub = Submission("sbatch", job_id, str(run_dir), str(script_path))
        record_submission(sub)
        if on_job_id is not None:
            on_job_id(job_id)
        return sub


def script_path(run_dir: str) -> Path:
    return RunDir(run_dir).script
