"""cancel, preempt: act on a run through the executor it was submitted with."""

from __future__ import annotations

import click

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.procs import SubprocessCommands
from hpc_ddp.launch.executors import executor_for_run
from hpc_ddp.launch.registry import resolve


@click.command()
@click.argument("job")
def cancel(job: str) -> None:
    """Cancel JOB (a job id or a run dir): scancel on Slurm, or stop the local executor (its ranks
    checkpoint first; it is not restarted)."""
    run = resolve(job)
    click.echo(executor_for_run(run.executor, SubprocessCommands()).cancel(run))


@click.command()
@click.argument("job")
@click.option("--signal", "sig", help="Signal to send [default: the job's warning signal, e.g. USR2].")
def preempt(job: str, sig: str | None) -> None:
    """Rehearse a preemption: send the warning signal to every rank of JOB (local or Slurm). The ranks
    checkpoint at the next step and the job requeues itself."""
    from hpc_ddp.spec.jobspec import SIGNALS, load_spec

    run = resolve(job)
    name = (sig or load_spec(run.paths.spec).signal).upper().removeprefix("SIG")
    if name not in SIGNALS:
        raise UserError(f"--signal {sig!r} is not one of {', '.join(SIGNALS)}")
    executor_for_run(run.executor, SubprocessCommands()).signal(run, name)
    click.echo(f"Sent SIG{name} to every rank of job {run.job_id}")


COMMANDS = [cancel, preempt]
