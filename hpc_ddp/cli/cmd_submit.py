"""submit, render, doctor: plan a job (pure, what --dry-run shows) and hand it to an executor."""

from __future__ import annotations

import datetime as _dt
import json
import shlex
import sys

import click

from hpc_ddp.cli.options import build, executor_for, spec_options, warn
from hpc_ddp.common.procs import SubprocessCommands
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.launch.rundirs import new_run_dir


@click.command(context_settings={"allow_interspersed_args": False})
@spec_options
@click.option("--dry-run", is_flag=True, help="Print the exact script (or plan); submit nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--no-preflight", is_flag=True, help="Skip the checks against the cluster (see `hpc-ddp doctor`).")
def submit(**params) -> None:
    """Submit TARGET (a script, -m module, or a job file) on N nodes x G GPUs.

    \b
      hpc-ddp submit --nodes 4 --gpus 8 train.py -- --lr 0.1
      hpc-ddp submit --dry-run --nodes 2 --gpus 4 -m mypkg.train
    """
    from hpc_ddp.launch.registry import record_run

    spec = build(params)
    executor, now, which = executor_for(spec)
    _chains_need_support(spec, executor)
    plan = executor.plan(spec, new_run_dir(spec, now))
    if not params["as_json"] or not spec.executor:
        warn(which)
    if params["dry_run"]:
        if params["as_json"]:
            click.echo(json.dumps({"executor": plan.executor, "job_id": None, "run_dir": plan.run_dir,
                                   "script": plan.dry_run_text(), "dry_run": True}, indent=2))
        else:
            click.echo(plan.dry_run_text(), nl=False)
        return
    if executor.queues and not params["no_preflight"]:
        _preflight(plan)
    sub = executor.submit(plan, on_job_id=lambda job_id: record_run(spec, plan.run_dir, job_id, executor.name, warn))
    if params["as_json"]:
        click.echo(json.dumps(sub.to_json(), indent=2))
    elif len(getattr(sub, "job_ids", ())) > 1:
        click.echo(f"Submitted jobs {', '.join(sub.job_ids)} ({sub.executor}; a chain: each starts when the one "
                   f"before ends and resumes the run); run dir {sub.run_dir}")
    elif sub.state == "SUBMITTED":
        click.echo(f"Submitted job {sub.job_id} ({sub.executor}); run dir {sub.run_dir}")
    else:  # it ran here, to its end
        warn(f"{sub.executor} job {sub.job_id} {sub.state.lower()} (exit code {sub.returncode}); run dir {sub.run_dir}")
        if sub.state == "CHECKPOINTED":
            warn("submit it again with the same --run-dir to resume")
    if sub.returncode:
        sys.exit(1)


def _chains_need_support(spec, executor) -> None:
    """--after and --chain make Slurm jobs wait for each other, which only an executor that says so
    (`chains`) does: the spec refuses another one named; this catches the one chosen for the user
    (no sbatch here: local)."""
    from hpc_ddp.common.errors import UserError

    if (spec.after or spec.chain > 1) and not getattr(executor, "chains", False):
        asked = "--after" if spec.after else f"--chain {spec.chain}"
        raise UserError(f"{asked}: only the sbatch executor queues Slurm jobs that wait for each other, not "
                        f"{executor.name}", hint="load Slurm (put sbatch on PATH), or drop it")


def _preflight(plan) -> None:
    from hpc_ddp.launch.preflight import Host, gate, job_paths, run_preflight

    gate(run_preflight(plan.spec, SubprocessCommands(), Host.current(), paths=job_paths(plan.spec, plan.run_dir)),
         warn)


@click.command(context_settings={"allow_interspersed_args": False})
@spec_options
@click.option("--json", "as_json", is_flag=True, help="Print the cluster and the findings as JSON.")
def doctor(**params) -> None:
    """Check a job against the cluster before it queues, and show the cluster: partitions, nodes, CPUs,
    memory, GPUs and time limits (sinfo); whether the request fits; account/QoS (sbatch --test-only);
    paths the nodes cannot read; SBATCH_*/SLURM_* variables in this shell. Exit 2 if the job cannot run
    as asked. Without TARGET only the resources and the shell are checked.

    \b
      hpc-ddp doctor
      hpc-ddp doctor --nodes 2 --gpus 4 --time 4:00:00 --partition gpu train.py
    """
    from hpc_ddp.launch.executors import choose_executor, get_executor
    from hpc_ddp.launch.preflight import NO_TARGET, Host, doctor_report
    from hpc_ddp.slurm.cluster import format_cluster

    spec, commands = build(params, default_target=NO_TARGET), SubprocessCommands()
    name, why = choose_executor(spec.executor, commands.which("sbatch") is not None)
    queues = get_executor(name, commands=commands).queues
    run_dir = new_run_dir(spec, _dt.datetime.now()) if queues else ""
    report = doctor_report(spec, queues, commands, Host.current(), run_dir)
    if params["as_json"]:
        click.echo(json.dumps({"executor": name, **report.to_json()}, indent=2))
    else:
        lines = [f"executor {name} ({why})", *(format_cluster(report.cluster) if report.cluster else [])]
        click.echo("\n".join(lines + [finding.line() for finding in report.findings]))
    sys.exit(2 if report.errors else 0)


@click.command(context_settings={"allow_interspersed_args": False})
@spec_options
@click.option("--stdout", "to_stdout", is_flag=True, help="Print the script instead of writing the run dir.")
def render(to_stdout: bool, **params) -> None:
    """Write the sbatch script (and spec) into the run dir without submitting it."""
    from hpc_ddp.launch.executors.base import write_run_dir

    spec = build({**params, "executor": "sbatch"})
    executor, now, _ = executor_for(spec)
    plan = executor.plan(spec, new_run_dir(spec, now))
    if to_stdout:
        click.echo(plan.script, nl=False)
        return
    run_dir = write_run_dir(plan)
    script = RunDir(run_dir).script
    script.write_text(plan.script or "")
    click.echo(f"Wrote {script}; submit it with: cd {shlex.quote(str(run_dir))} && sbatch {script.name}")


@click.command(context_settings={"allow_interspersed_args": False})
@spec_options
@click.option("--dry-run", is_flag=True, help="Print the srun command line (and the policy's calls around it); run nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
def run(ctx: click.Context, **params) -> None:
    """Run TARGET now, as a job step of the Slurm allocation this shell is in (after salloc), in the
    foreground: short for `hpc-ddp submit --executor srun`. Nodes, GPUs and ranks per node not given
    are the allocation's. Ctrl-C: the ranks checkpoint and stop.

    \b
      salloc -N2 --gpus-per-node=2 --ntasks-per-node=2
      hpc-ddp run train.py -- --lr 0.1
    """
    from hpc_ddp.launch.executors.srun import NAME

    if params["executor"] not in (None, NAME):
        raise click.UsageError(f"hpc-ddp run always uses --executor {NAME}; use hpc-ddp submit for another")
    ctx.invoke(submit, **{**params, "executor": NAME, "no_preflight": True})


COMMANDS = [submit, doctor, render, run]
