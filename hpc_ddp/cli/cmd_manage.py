"""cancel, preempt: act on a run through the executor it was submitted with.

`--json` prints one object with stable keys (README, "Watching and managing"):

    cancel    {"action": "cancel", "job_id", "run_dir", "executor", "message"}
    preempt   {"action": "preempt", "job_id", "run_dir", "executor", "signal", "message"}

`message` is the line the command prints without --json. A refusal is not JSON: one line on stderr and
exit 2 (or 1), as for every command.
"""

from __future__ import annotations

import json
import os
import shlex

import click

from hpc_ddp.cli.options import warn
from hpc_ddp.cli.remote import over_ssh
from hpc_ddp.common.errors import HpcDdpError, UserError
from hpc_ddp.common.procs import SubprocessCommands
from hpc_ddp.common.rundir import is_sweep_dir
from hpc_ddp.common.terminal import printable
from hpc_ddp.launch.executors import executor_for_run
from hpc_ddp.watch.registry import resolve


@click.command()
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@over_ssh()
def cancel(job: str, as_json: bool) -> None:
    """Cancel JOB (a job id or a run dir): scancel on Slurm, or stop the local executor (its ranks
    checkpoint first; it is not restarted)."""
    run = resolve(job)
    commands = SubprocessCommands()
    executor = executor_for_run(run.executor, commands)
    if is_sweep_dir(run.run_dir):  # every task still queued or running
        from hpc_ddp.launch.sweep import cancel_sweep, in_state
        from hpc_ddp.watch.status import LIVE

        message = "\n".join(cancel_sweep(run.run_dir, executor, in_state(run.run_dir, executor, commands, LIVE)))
    else:
        message = executor.cancel(run)
    _done(as_json, "cancel", message, run, executor.name)


@click.command()
@click.argument("job")
@click.option("--signal", "sig", help="Signal to send [default: the job's warning signal, e.g. USR2].")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@over_ssh()
def preempt(job: str, sig: str | None, as_json: bool) -> None:
    """Rehearse a preemption: send the warning signal to every rank of JOB (local or Slurm). The ranks
    checkpoint at the next step and the job requeues itself."""
    from hpc_ddp.launch import sweep
    from hpc_ddp.spec.jobspec import SIGNALS, load_spec

    run = resolve(job)
    is_sweep = is_sweep_dir(run.run_dir)
    spec_path = sweep.first_task_spec(run.run_dir) if is_sweep else run.paths.spec
    name = (sig or load_spec(spec_path).signal).upper().removeprefix("SIG")
    if name not in SIGNALS:  # named as where it came from: the flag, or the run's spec (edited by hand)
        said = f"--signal {sig!r}" if sig else f"the job's signal {name!r} (its {spec_path})"
        raise UserError(f"{said} is not one of {', '.join(SIGNALS)}", hint="give --signal USR1, USR2 or TERM")
    commands = SubprocessCommands()
    executor = executor_for_run(run.executor, commands)
    if is_sweep:
        running = sweep.in_state(run.run_dir, executor, commands, ("RUNNING",))
        message = sweep.signal_sweep(run.run_dir, executor, name, running)
    else:
        _refuse_finished(run)
        here = getattr(executor, "ranks_here", False)
        if name == "TERM" and not here:
            from hpc_ddp.job.attempts import record_rehearsal

            record_rehearsal(run.run_dir, name)   # before the signal: the attempt's end reads it
            ends = _attempt_ends(run)
        executor.signal(run, name)
        message = f"Sent SIG{name} to every rank of job {run.job_id}"
        if name == "TERM" and here:
            message += ("; ranks still running 30 s later are killed and the job runs again, as after a Slurm "
                        "preemption")
        elif name == "TERM":
            message += "; however its program leaves, the attempt counts as preempted and the job runs again"
            end_steps = getattr(executor, "end_steps", None)
            if end_steps is not None and not _attempt_ended(run, ends, REHEARSAL_KILL_WAIT_S) and end_steps(run):
                # as Slurm's KillWait after a real preemption's SIGTERM: the ranks' step ends, the job goes on
                message += (f"; its ranks were still running {REHEARSAL_KILL_WAIT_S:g} s later and were killed, as "
                            "Slurm kills them after a preemption")
        elif name != "USR1":
            _ignored_by_framework(run, name)
    _done(as_json, "preempt", message, run, executor.name, signal=name)


# After a rehearsed SIGTERM, how long the ranks of a Slurm job have to leave before they are killed: Slurm's
# default KillWait, as the local executor gives them. A program that hangs in its SIGTERM handler (Lightning
# 2.6 under DDP can: docs/frameworks.md) would otherwise hold its nodes until the time limit.
REHEARSAL_KILL_WAIT_S = 30.0


def _attempt_ends(run) -> int:
    from hpc_ddp.common.events import read_jsonl

    return sum(1 for e in read_jsonl(run.paths.events) if e.get("event") == "attempt_end")


def _attempt_ended(run, before: int, within: float) -> bool:
    """Did the attempt the rehearsal reached record its end within `within` seconds (polled each second)?"""
    import time

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if _attempt_ends(run) > before:
            return True
        time.sleep(1.0)
    return _attempt_ends(run) > before


def _refuse_finished(run) -> None:
    """A run whose training has finished has nothing left to stop: a preempt sent now would say it was sent
    and change nothing (its ranks are saving their last checkpoint, or gone)."""
    from hpc_ddp.job.attempts import finished_in_last_attempt

    if run.paths.events.is_file() and finished_in_last_attempt(run.run_dir):
        raise UserError(f"job {run.job_id} has already finished training ({run.run_dir}): there is nothing to preempt",
                        hint="preempt while it trains: `hpc-ddp status` says RUNNING and shows its progress")


def _ignored_by_framework(run, name: str) -> None:
    """Lightning, the Hugging Face Trainer and accelerate leave the warning signal alone: said, with the
    signal a preemption sends them, instead of a rehearsal in which nothing happens."""
    from hpc_ddp.checks.frameworks import framework_of
    from hpc_ddp.job.devicescan import source_of
    from hpc_ddp.spec.jobspec import load_spec

    try:
        spec = load_spec(run.paths.spec)
        found = source_of(spec.target.kind, spec.target.value, spec.workdir)
    except (HpcDdpError, OSError, ValueError):
        return
    framework = framework_of(found[1]) if found else None
    if framework is not None and "hpc_ddp" not in found[1]:
        warn(f"warning: {os.path.basename(found[0])} uses {framework}, which leaves SIG{name} alone: nothing stops "
             "HINT: rehearse a preemption with the signal a preemption sends: hpc-ddp preempt --signal TERM "
             f"{shlex.quote(str(run.run_dir))} (docs/frameworks.md)")


def _done(as_json: bool, action: str, message: str, run, executor: str, **extra: str) -> None:
    if not as_json:
        click.echo(printable(message))
        return
    click.echo(json.dumps({"action": action, "job_id": run.job_id, "run_dir": str(run.run_dir), "executor": executor,
                           **extra, "message": message}, indent=2))


COMMANDS = [cancel, preempt]
