"""rerun: replay one attempt of a run here (the logic: `debug.rerun`); attach: the owner's way to a debug
rank (`debug.attach`).

rerun's `--json` prints {"rerun": the plan as rerun.json records it, "executor", "job_id", "state", "returncode",
"original_failure", "rerun_failure"}; a refusal is one line on stderr, exit 2, nothing written.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import signal
import sys

import click

from hpc_ddp.common import verbosity
from hpc_ddp.common.terminal import printable

__all__ = ["COMMANDS", "attach", "rerun"]


@click.command()
@click.argument("run")
@click.option("--attempt", type=click.IntRange(min=0), help="The attempt to replay [default: the last that failed].")
@click.option("--job", help="The job the attempt belongs to, where a chain's jobs each have an attempt N.")
@click.option("--executor", type=click.Choice(["local"]), default="local", show_default=True,
              help="Where it runs: on this machine.")
@click.option("--nodes", type=click.IntRange(min=1), help="Simulated nodes [default: the job's, where they fit].")
@click.option("--tasks-per-node", type=click.IntRange(min=1), help="Ranks per simulated node [default: the job's].")
@click.option("--run-dir", help="The rerun's run dir [default: beside RUN, NAME-rerun-JOB-aN-TIME].")
@click.option("--any-outcome", is_flag=True, help="Replay an attempt that did not fail (completed, preempted, ...).")
@click.option("--dry-run", is_flag=True, help="Say what would be replayed and what changes; run nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as one JSON object.")
def rerun(run: str, attempt: int | None, job: str | None, executor: str, nodes: int | None,
          tasks_per_node: int | None, run_dir: str | None, any_outcome: bool, dry_run: bool, as_json: bool) -> None:
    """Replay an attempt of RUN (a run dir or job id) on this machine: the same spec, data and rank
    environment, from the checkpoint it started from (copied into a new run dir; RUN is never written to).

    \b
      hpc-ddp rerun runs/train-20261122-054742                 # the last failed attempt
      hpc-ddp rerun 8123 --attempt 2 --nodes 1 --tasks-per-node 2
    """
    from hpc_ddp.common.machine import physical_gpus, usable_cpus
    from hpc_ddp.debug.rerun import plan_rerun
    from hpc_ddp.launch.executors import visible_gpus
    from hpc_ddp.watch.registry import resolve

    source = _source(resolve(run))
    plan = plan_rerun(source, attempt=attempt, job=job, any_outcome=any_outcome, nodes=nodes,
                      tasks_per_node=tasks_per_node, run_dir=run_dir, cpus=usable_cpus(),
                      gpus_here=visible_gpus(physical_gpus(), _cuda_visible()), now=_dt.datetime.now())
    if dry_run:
        click.echo(json.dumps(plan.to_json(), indent=2) if as_json else "\n".join(plan.describe()))
        return
    for line in plan.describe():
        verbosity.info(line)
    outcome = _run(plan, echo=not as_json)  # --json: stdout is the JSON alone; the ranks' output is in their logs
    if as_json:
        click.echo(json.dumps({"rerun": plan.to_json(), **outcome}, indent=2))
    else:
        for line in _compare(outcome):
            click.echo(line)
    sys.exit(0 if outcome["returncode"] == 0 else 1)


def _source(run):
    from hpc_ddp.common.errors import UserError
    from hpc_ddp.common.rundir import is_sweep_dir

    if is_sweep_dir(run.run_dir):
        raise UserError(f"{run.run_dir} is a sweep: each task is a run of its own",
                        hint="give one task's run dir (SWEEP/task-N) or its job id")
    return run.run_dir


def _cuda_visible() -> str | None:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


def _run(plan, echo: bool) -> dict:
    """Make the new run dir, run the attempt through the local executor, and say how both ended."""
    from hpc_ddp.cli.options import warn
    from hpc_ddp.debug.rerun import attempt_failure, make_rerun_dir
    from hpc_ddp.launch.executors.local import LocalExecutor
    from hpc_ddp.watch.registry import record_run

    make_rerun_dir(plan)
    executor = LocalExecutor(echo=echo)
    sub = executor.submit(executor.plan(plan.spec, str(plan.run_dir)),
                          on_job_id=lambda job_id: record_run(plan.spec, str(plan.run_dir), job_id, "local", warn))
    return {"executor": sub.executor, "job_id": sub.job_id, "state": sub.state, "returncode": sub.returncode,
            "run_dir": sub.run_dir, "original_failure": attempt_failure(plan.source, plan.record.job_id or "*",
                                                                        plan.record.number),
            "rerun_failure": attempt_failure(plan.run_dir, sub.job_id, 0)}


def _compare(outcome: dict) -> list[str]:
    was, now = outcome["original_failure"], outcome["rerun_failure"]
    lines = [f"rerun {outcome['state'].lower()} (exit code {outcome['returncode']}); run dir {outcome['run_dir']}"]
    lines.append(f"original attempt: {was or 'no failure found in its rank logs'}")
    lines.append(f"rerun:            {now or 'no failure found in its rank logs'}")
    if was and now:
        lines.append("the same failure" if was == now else "a different failure")
    return lines


@click.command()
@click.argument("job", required=False)
@click.option("--port", type=click.IntRange(1, 65535),
              help="Also listen on localhost:PORT here, for an IDE on this machine (VS Code Remote-SSH); only your "
                   "own connections are taken.")
def attach(job: str | None, port: int | None) -> None:
    """Relay to the rank of JOB that waits for a debugger (submit --debug-rank), for you alone; without JOB,
    the most recent run. Run it on the login node and leave it running: it serves a socket of yours here
    and reaches the rank's node through srun; it prints the ssh command that forwards your laptop's
    localhost:5678 to it.

    \b
      hpc-ddp attach 8123
      hpc-ddp attach runs/train-20261122-054742 --port 5678
    """
    from hpc_ddp.common.errors import UserError
    from hpc_ddp.common.procs import SubprocessCommands
    from hpc_ddp.debug.attach import serve
    from hpc_ddp.watch.registry import resolve
    from hpc_ddp.watch.status import run_status

    run = resolve(job)
    _source(run)  # a sweep: one of its tasks, please

    def waiting() -> dict | None:
        debug = run_status(run.run_dir, run.job_id, run.executor, SubprocessCommands()).get("debugger") or {}
        return debug if debug.get("owner_only") and debug.get("socket") else None

    event = waiting()
    if event is None:
        raise UserError(f"no rank of job {run.job_id or run.run_dir} waits for a debugger now",
                        hint="submit with --debug-rank R; `hpc-ddp status` shows the rank once it waits")
    python = _bridge_python(run, event)
    try:
        with _ends_like_ctrl_c(signal.SIGTERM, signal.SIGHUP):
            serve(event, port=port, current=waiting, say=lambda m: click.echo(printable(m), err=True), python=python)
    except KeyboardInterrupt:
        click.echo("", err=True)


@contextlib.contextmanager
def _ends_like_ctrl_c(*signums: int):
    """A `kill` or a closed terminal ends attach the way Ctrl-C does, through serve's cleanup: its socket
    removed, not left for the next attach of the same job id to find."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    before = {s: signal.signal(s, interrupt) for s in signums}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _bridge_python(run, event: dict) -> str:
    """The Python that runs attach's bridge: this hpc-ddp's for a local run (the bridge runs here), else
    the run's own interpreter as its spec (written by submit) names it. Never the debugger record's: the
    ranks write events.jsonl, and a record must not choose what runs here."""
    from hpc_ddp.common.rundir import RunDir
    from hpc_ddp.spec.jobspec import load_spec

    if event.get("loopback"):
        return sys.executable
    return load_spec(RunDir(run.run_dir).spec).python  # one line where it cannot be read


COMMANDS = [rerun, attach]
