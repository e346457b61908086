"""submit, render, doctor: plan a job (pure, what --dry-run shows) and hand it to an executor."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import shlex
import sys
from pathlib import Path

import click

from hpc_ddp.cli.options import build, executor_for, spec_options, warn
from hpc_ddp.common.durable import write_file
from hpc_ddp.common.errors import SpecError, UserError
from hpc_ddp.common.exitcodes import CANCELLED
from hpc_ddp.common.procs import SubprocessCommands
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.launch.rundirs import check_kind, check_not_live, new_run_dir
from hpc_ddp.spec.interpreter import explain


@click.command(context_settings={"allow_interspersed_args": False})
@spec_options
@click.option("--dry-run", is_flag=True, help="Print the exact script (or plan); submit nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--no-preflight", is_flag=True, help="Skip the checks against the cluster (see `hpc-ddp doctor`).")
@click.option("--sweep", multiple=True, metavar="KEY=V1,V2,...",
              help="Run one task per combination of values, each a whole job with its own run dir (a Slurm "
                   "array under sbatch). KEY: lr, epochs, batch_size, a [train] key, or args.NAME (your script "
                   "gets --NAME=V). Repeat for a grid. A job file's [sweep] table does the same.")
@click.option("--max-running", metavar="N", help="At most N tasks of the sweep run at once (Slurm's %N).")
@click.option("--ssh", metavar="HOST",
              help="Submit on HOST's cluster from here: the project is copied there (rsync) and the job submitted "
                   "there by its hpc-ddp; status, logs, cancel... then work from here too. A profile's ssh = "
                   "\"HOST\" does the same.")
@click.option("--shipped", hidden=True, help="(The cluster's side of --ssh: the manifest of the shipped project.)")
@click.pass_context
def submit(ctx: click.Context, **params) -> None:
    """Submit TARGET (a script, -m module, or a job file) on N nodes x G GPUs.

    \b
      hpc-ddp submit --nodes 4 --gpus 8 train.py -- --lr 0.1
      hpc-ddp submit --dry-run --nodes 2 --gpus 4 -m mypkg.train
      hpc-ddp submit --nodes 2 --gpus 4 --sweep lr=0.1,0.01 --sweep batch_size=32,64 job.toml
    """
    from hpc_ddp.watch.registry import record_run

    if params["shipped"] is None:
        from hpc_ddp.remote.site import site_for
        from hpc_ddp.spec.config import chosen_profile

        profile, job = chosen_profile(tuple(params["argv"]), params["module"], params["profile"], Path.cwd(),
                                      os.environ)
        site = site_for(params["ssh"], profile)
        if site is not None:  # the cluster's hpc-ddp submits: the profile named there as it was chosen here
            _queued_over_ssh(params, job, site)
            from hpc_ddp.remote.argv import words_of
            from hpc_ddp.remote.submit import submit_over_ssh

            words = words_of(ctx.command, {**params, "profile": profile}, drop=("ssh", "shipped", "as_json"))
            sys.exit(submit_over_ssh(site, params, words, job))
    spec = build(params)
    sweep = _sweep(params, spec)
    if sweep is not None:
        _submit_sweep(params, spec, sweep)
        return
    executor, now, which = executor_for(spec)
    _chains_need_support(spec, executor)
    _restarts_here(params, executor)
    run_dir = new_run_dir(spec, now)
    check_kind(run_dir, sweep=False)
    check_not_live(run_dir, SubprocessCommands())
    snap = _plan_snapshot(spec, run_dir, read=params["dry_run"], shipped=params["shipped"])
    plan = executor.plan(_pinned(spec, snap), run_dir)
    if not params["as_json"] or not spec.executor:
        warn(which)
        warn(explain(spec))
    _devices(plan.spec, params["no_preflight"], params["dry_run"])
    if params["dry_run"]:
        _ranks_python(plan.spec, executor, dry_run=True)
        _say_snapshot_plan(spec, snap)
        if params["as_json"]:
            click.echo(json.dumps({"executor": plan.executor, "job_id": None, "run_dir": plan.run_dir,
                                   "script": plan.dry_run_text(), "dry_run": True,
                                   "code": _code_json(plan.spec)}, indent=2))
        else:
            click.echo(plan.dry_run_text(), nl=False)
        return
    from hpc_ddp.job.debugger import refuse_missing_debugpy

    refuse_missing_debugpy([plan.spec])  # only now that it will run: a dry run executes nothing
    if executor.queues and not params["no_preflight"]:
        _preflight(plan)
    executor.check(plan)  # what the executor refuses, before the snapshot writes anything
    _ranks_python(plan.spec, executor, dry_run=False)  # one it can start: does it import hpc_ddp?
    if snap is not None:
        snap = _take_snapshot(snap, run_dir, [run_dir])
        if snap.id != plan.spec.code.id:  # known once the files are read (or one changed since the dry plan)
            plan = executor.plan(_pinned(spec, snap), run_dir)
    else:
        _say_snapshot_plan(spec, None)
    spec = plan.spec
    sub = executor.submit(plan, on_job_id=lambda job_id: record_run(spec, plan.run_dir, job_id, executor.name, warn))
    if params["as_json"]:
        click.echo(json.dumps({**sub.to_json(), "code": _code_json(spec)}, indent=2))
    elif len(getattr(sub, "job_ids", ())) > 1:
        click.echo(f"Submitted jobs {', '.join(sub.job_ids)} ({sub.executor}; a chain: each starts when the one "
                   f"before ends and resumes the run); run dir {sub.run_dir}")
    elif sub.state == "SUBMITTED":
        click.echo(f"Submitted job {sub.job_id} ({sub.executor}); run dir {sub.run_dir}")
    else:  # it ran here, to its end
        said = {"TIMEOUT": "stopped at its time limit"}.get(sub.state, sub.state.lower())
        warn(f"{sub.executor} job {sub.job_id} {said} (exit code {sub.returncode}); run dir {sub.run_dir}")
        if sub.state == "CHECKPOINTED":
            warn("submit it again with the same --run-dir to resume")
    if sub.state == "CANCELLED":  # asked for (Ctrl-C, hpc-ddp cancel): not a failure, and said apart from one
        sys.exit(CANCELLED)
    if sub.returncode:
        sys.exit(1)


def _sweep(params: dict, spec):
    from hpc_ddp.spec.config import is_job_file, read_toml
    from hpc_ddp.spec.sweep import check_no_flag_conflict, sweep_from

    head = params["argv"][0] if params["argv"] and not params["module"] else None
    table = read_toml(Path(head).resolve(), "job file").get("sweep") if head and is_job_file(head) else None
    if table is not None and not isinstance(table, dict):
        raise SpecError("the job file's sweep must be a table: [sweep] with KEY = [values]")
    sweep = sweep_from(params["sweep"], table, params["max_running"], spec.target.kind)
    if sweep is not None:
        check_no_flag_conflict(sweep, params)
    return sweep


def _submit_sweep(params: dict, spec, sweep) -> None:
    """Plan every task (each spec built and checked like a single job's), then one array or task by task."""
    from hpc_ddp.launch.sweep import check_resubmission, plan_sweep, submit_sweep
    from hpc_ddp.spec.sweep import check_spec, describe, task_spec
    from hpc_ddp.watch.registry import record_run

    check_spec(spec)
    executor, now, which = executor_for(spec)
    _restarts_here(params, executor)
    sweep_dir = new_run_dir(spec, now)
    check_kind(sweep_dir, sweep=True)
    snap = _plan_snapshot(spec, sweep_dir, read=params["dry_run"], shipped=params["shipped"])  # one copy for all tasks

    def planned(snap):
        return plan_sweep(executor, sweep, sweep_dir, lambda values, index: _pinned(
            task_spec(spec, values, index, lambda extra: build(params, extra=extra)), snap))
    plan = planned(snap)
    check_resubmission(plan, executor)  # --dry-run says what the submission would
    _devices(plan.tasks[0].plan.spec, params["no_preflight"], params["dry_run"])
    if plan.script is not None:
        from hpc_ddp.checks.preflight import read_slurm_config
        from hpc_ddp.launch.sweep import check_array_size

        check_array_size(len(plan.tasks), read_slurm_config(SubprocessCommands()))
    if not params["as_json"] or not spec.executor:
        warn(which)
        warn(explain(spec))
    if params["dry_run"]:
        _ranks_python(plan.tasks[0].plan.spec, executor, dry_run=True)
        _say_snapshot_plan(spec, snap)
        click.echo(json.dumps({"executor": plan.executor, "sweep_dir": plan.sweep_dir, "dry_run": True,
                               "script": plan.script, "tasks": [{"task": t.index, "values": dict(t.values),
                                                                  "run_dir": t.run_dir} for t in plan.tasks]},
                              indent=2) if params["as_json"] else plan.dry_run_text(), nl=params["as_json"])
        return
    from hpc_ddp.job.debugger import refuse_missing_debugpy

    refuse_missing_debugpy(t.plan.spec for t in plan.tasks)  # each distinct Python once, not once per task
    _ranks_python(plan.tasks[0].plan.spec, executor, dry_run=False)
    if executor.queues and not params["no_preflight"]:
        _preflight(plan.tasks[0].plan)
    if snap is not None:
        taken = _take_snapshot(snap, sweep_dir, [t.run_dir for t in plan.tasks])
        if taken.id != snap.id:
            plan = planned(taken)
    else:
        _say_snapshot_plan(spec, None)

    def recorded(task, job_id: str) -> None:
        array = job_id.partition("_")[0] if plan.script is not None else None
        record_run(task.plan.spec, task.run_dir, job_id, executor.name, warn,
                   {"sweep": plan.sweep_dir, "task": task.index, "values": dict(task.values),
                    **({"array_job_id": array} if array else {})})
    if plan.script is None and not params["as_json"]:  # tasks run one by one from here: say where, first
        warn(f"sweep dir {plan.sweep_dir}: {len(plan.tasks)} task{'s' if len(plan.tasks) != 1 else ''}, run one "
             f"after another; watch it from another shell: hpc-ddp status {shlex.quote(plan.sweep_dir)}")
    subs = submit_sweep(executor, plan, recorded)
    if params["as_json"]:
        click.echo(json.dumps({"executor": plan.executor, "sweep_dir": plan.sweep_dir,
                               "array_job_id": subs[0].job_id.partition("_")[0] if plan.script else None,
                               "tasks": [{"task": t.index, "values": dict(t.values), **s.to_json()}
                                         for t, s in zip(plan.tasks, subs)]}, indent=2))
    elif plan.script is not None:
        click.echo(f"Submitted array job {subs[0].job_id.partition('_')[0]} ({plan.executor}): {len(subs)} "
                   f"task{'s' if len(subs) != 1 else ''}, "
                   f"sweep dir {plan.sweep_dir}")
        for task, sub in zip(plan.tasks, subs):
            click.echo(f"  task {task.index}: job {sub.job_id}  {describe(task.values)}")
        click.echo(f"Watch it: hpc-ddp status {shlex.quote(plan.sweep_dir)}")
    else:
        for task, sub in zip(plan.tasks, subs):
            click.echo(f"task {task.index}: {sub.executor} job {sub.job_id} {sub.state.lower()}  "
                       f"{describe(task.values)}")
        if len(subs) < len(plan.tasks):
            warn(f"stopped after task {len(subs) - 1}; tasks {len(subs)}..{len(plan.tasks) - 1} did not run")
        click.echo(f"sweep dir {plan.sweep_dir}; hpc-ddp status {shlex.quote(plan.sweep_dir)} shows every task")
    if any(s.returncode for s in subs):
        sys.exit(1)


def _plan_snapshot(spec, where: str, read: bool, shipped: str | None = None):
    """The snapshot of the spec's project that goes into `where`/code (None: nothing to pin). Writes nothing;
    `read`: hash the files now (a dry run shows the id), else they are read once, as they are copied.
    `shipped`: the manifest of a project a laptop shipped here (submit --ssh), which lists the files."""
    from hpc_ddp.snapshot.snapshot import CODE_DIR, plan

    return plan(spec, str(Path(where) / CODE_DIR), read=read, shipped=_shipped(shipped) if shipped else None)


def _shipped(path: str):
    """The listing and hashes of the manifest at MIRROR/.hpc-ddp-mirror/shipped/ID.json."""
    from hpc_ddp.common.errors import UserError
    from hpc_ddp.remote.submit import MARK
    from hpc_ddp.snapshot import shipped

    manifest = Path(os.path.realpath(path))
    if manifest.parent.name != "shipped" or manifest.parent.parent.name != MARK:
        raise UserError(f"--shipped {path}: not a manifest of a shipped project",
                        hint="--shipped is hpc-ddp's own, for submit --ssh")
    try:
        data = json.loads(manifest.read_bytes())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the shipped manifest {path}: {exc}", hint="submit again from the laptop") from None
    return shipped.listing(data, manifest.parent.parent.parent)


def _pinned(spec, snap):
    return dataclasses.replace(spec, code=snap.code()) if snap is not None else spec


def _take_snapshot(snap, where: str, run_dirs: list[str]):
    """Copy the project; say what was copied and, for a run dir submitted before, what changed since.
    `where` (the run dir, or a sweep's dir) is made as a run dir is: the user's alone; each of `run_dirs`
    gets the record of the snapshot."""
    from hpc_ddp.common.errors import HpcDdpError
    from hpc_ddp.snapshot.snapshot import record, take
    from hpc_ddp.spec.jobspec import load_spec

    previous = None
    if len(run_dirs) == 1 and RunDir(run_dirs[0]).spec.is_file():
        try:
            previous = load_spec(RunDir(run_dirs[0]).spec).code
        except HpcDdpError:
            previous = None
    Path(where).mkdir(parents=True, exist_ok=True, mode=0o700)
    taken = take(snap)
    for line in record(taken, run_dirs, previous):
        warn(line)
    return taken


def _say_snapshot_plan(spec, snap) -> None:
    if snap is not None:
        warn(snap.describe().replace("code: snapshot", "code: would snapshot", 1))
        for note in snap.listing.notes:
            warn(f"code: note: {note}")
    elif not spec.snapshot:
        warn("code: not pinned (--no-snapshot): every attempt runs the working tree as it is when it starts")
    elif spec.target.kind == "module":
        warn(f"code: -m {spec.target.value} is not in the working directory: it runs as installed, not pinned")


def _code_json(spec) -> dict | None:
    return dataclasses.asdict(spec.code) if spec.code is not None else None


def _devices(spec, no_preflight: bool = False, dry_run: bool = False) -> None:
    """The script's way of picking its GPU against the job's binding, and that it compiles (with the ranks'
    own Python where it is another, except in a dry run): a warning, or exit 2 where it cannot work (before
    the dry run too: it shows what would be submitted)."""
    from hpc_ddp.checks.preflight import gate_devices

    gate_devices(spec, warn, no_preflight, dry_run)


def _restarts_here(params, executor) -> None:
    """--max-restarts given where nothing restarts: only the batch script of the sbatch executor restarts a
    step inside its allocation (templates/sbatch.sh.j2); elsewhere a crash ends the attempt as it always did.
    A note, not a refusal: a profile or an alias may pass it to every executor."""
    given = params.get("max_restarts")
    if given is None or str(given).strip() in ("", "0") or getattr(executor, "restarts_in_place", False):
        return
    name = getattr(executor, "name", "this")
    warn(f"warning: --max-restarts {given}: the {name} executor restarts nothing inside an allocation (only sbatch's batch "
         "script does); a crash ends the attempt, and the requeue rules decide what follows")


def _ranks_python(spec, executor, dry_run: bool) -> None:
    """The local executor starts the ranks here: their Python must import hpc_ddp (the sbatch path's
    preflight asks the same), said before anything runs; in a dry run too, which executes nothing and reads
    the env's files instead."""
    if getattr(executor, "ranks_here", False):
        from hpc_ddp.checks.preflight import gate_ranks_python

        gate_ranks_python(spec, warn, dry_run=dry_run)


# Executors that run the job in the foreground of the submitting process: over ssh that process is the cluster's
# submit, whose output is the laptop's answer, on the login node.
_FOREGROUND = ("local", "srun")


def _queued_over_ssh(params: dict, job: dict, site) -> None:
    """submit --ssh queues the job on the cluster: an executor that would run it in the foreground of the
    cluster's submit (on its login node, its ranks' output mixed into the answer) is refused here."""
    for origin, value in (("--executor", params.get("executor")), ("the job file's executor", (job or {}).get("executor")),
                          ("the profile's executor", (site.profile or {}).get("executor"))):
        if value in _FOREGROUND:
            raise UserError(f"{origin} {value} with --ssh would run the job on {site.host}'s login node, in the "
                            "foreground of the submit there", hint="leave --executor out (the cluster's Slurm "
                            "queues it), or run hpc-ddp submit --executor local on the machine itself")
        if value is not None:
            return


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
    from hpc_ddp.checks.preflight import Host, gate, job_paths, run_preflight

    commands = SubprocessCommands()
    gate(run_preflight(plan.spec, commands, Host.current(), paths=job_paths(plan.spec, plan.run_dir)), warn)


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
    from hpc_ddp.checks.preflight import NO_TARGET, Host, doctor_report
    from hpc_ddp.launch.executors import choose_executor, get_executor
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
    run_dir = new_run_dir(spec, now)
    check_kind(run_dir, sweep=False)
    check_not_live(run_dir, SubprocessCommands())
    snap = _plan_snapshot(spec, run_dir, read=to_stdout)
    plan = executor.plan(_pinned(spec, snap), run_dir)
    if to_stdout:
        click.echo(plan.script, nl=False)
        return
    if snap is not None:  # the script will run whenever it is submitted: the code as it is now
        taken = _take_snapshot(snap, run_dir, [run_dir])
        if taken.id != snap.id:
            plan = executor.plan(_pinned(spec, taken), run_dir)
    run_dir = write_run_dir(plan)
    script = RunDir(run_dir).script
    write_file(script, plan.script or "", 0o700)
    click.echo(f"Wrote {script}; submit it with: cd {shlex.quote(str(run_dir))} && sbatch {shlex.quote(script.name)}")


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
