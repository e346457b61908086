"""status, logs, list, timeline, plot: what a run is doing and did, from its executor and its run dir."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import click

from hpc_ddp.cli.options import warn
from hpc_ddp.cli.remote import over_ssh
from hpc_ddp.common.errors import UserError
from hpc_ddp.common.procs import SubprocessCommands
from hpc_ddp.common.rundir import is_sweep_dir
from hpc_ddp.common.terminal import printable
from hpc_ddp.launch.rundirs import on_kernel_fs
from hpc_ddp.watch.registry import resolve


@click.command()
@click.argument("job", required=False)
@click.option("--json", "as_json", is_flag=True)
@click.option("-w", "--watch", is_flag=True, help="Print step, samples/s and ETA every --interval seconds until "
                                                  "the job ends (Ctrl-C stops watching, not the job).")
@click.option("--interval", type=click.FloatRange(0.2, 3600), default=5.0, show_default=True,
              help="Seconds between --watch lines.")
@click.option("--tunnel", is_flag=True,
              help="For a rank waiting for a debugger (--debug-rank): a job submitted from here over ssh gets its "
                   "tunnel opened, through the shared connection (attach to the localhost port it prints); "
                   "another prints the ssh command to run on your laptop, which reaches `hpc-ddp attach JOB` "
                   "(keep it running on the login node).")
@over_ssh()
def status(job: str | None, as_json: bool, watch: bool, interval: float, tunnel: bool) -> None:
    """State, restarts, last checkpoint, progress, ETA, where the time went and last event of JOB (a job
    id or a run dir); without JOB, the most recent run."""
    from hpc_ddp.watch.status import LIVE, format_status, progress_line

    run = resolve(job)
    if is_sweep_dir(run.run_dir):
        _sweep_status(run, as_json)
        return
    info = _status(run)
    if tunnel:
        if not info.get("debugger") or not info["debugger"].get("tunnel"):
            raise UserError(f"no rank of job {run.job_id or run.run_dir} waits for a debugger now",
                            hint="submit with --debug-rank R; `hpc-ddp status` shows the rank once it waits")
        click.echo(info["debugger"]["tunnel"])
        return
    try:
        while watch and info["state"] in LIVE:
            click.echo(printable(progress_line(info, time.time())))
            time.sleep(interval)
            info = _status(run)
    except KeyboardInterrupt:  # stop watching; the job goes on
        click.echo("")
        return
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    for line in format_status(info):
        click.echo(printable(line))


def _one_run(job: str | None):
    """The run JOB names, where a command needs one run, not a sweep of them."""
    run = resolve(job)
    if is_sweep_dir(run.run_dir):
        raise UserError(f"{job or run.run_dir} is a sweep: give one of its tasks",
                        hint=f"e.g. {run.job_id}_0 or {run.run_dir / 'task-0'}; `hpc-ddp status` shows the tasks"
                        if run.job_id else f"e.g. {run.run_dir / 'task-0'}; `hpc-ddp status` shows the tasks")
    return run


def _sweep_status(run, as_json: bool) -> None:
    from hpc_ddp.launch.executors import executor_for_run
    from hpc_ddp.launch.sweep import format_sweep, sweep_status
    from hpc_ddp.slurm.jobstate import array_states
    from hpc_ddp.watch.status import run_status

    commands = SubprocessCommands()
    # One question to Slurm for the whole array; a task the answer does not name is asked on its own.
    known = array_states(run.job_id, commands) if run.job_id and executor_for_run(run.executor).queues else {}
    info = sweep_status(run.run_dir, lambda d, j, e: run_status(d, j, e, commands, sched=known.get(str(j))))
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    for line in format_sweep(info):
        click.echo(printable(line))


def _status(run) -> dict:
    from hpc_ddp.watch.status import run_status

    return run_status(run.run_dir, run.job_id, run.executor, SubprocessCommands())


# States in which `logs -f` waits for more lines (a job held after a requeue would keep it forever).
_FOLLOWED = ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING")


@click.command()
@click.argument("job", required=False)
@click.option("--rank", type=int, help="Only this rank.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines while the job runs.")
@click.option("--json", "as_json", is_flag=True,
              help='One JSON object per line: {"attempt": A, "rank": R, "line": TEXT}.')
@click.option("--from", "start", hidden=True,
              help="(For logs -f from a laptop: JSON {log path: byte offset} to start from; each JSON line then "
                   "also says where it ends: path, end, part, parts.)")
@over_ssh(how="follow")
def logs(job: str | None, rank: int | None, follow: bool, as_json: bool, start: str | None) -> None:
    """Every rank's log across all attempts, each line prefixed by attempt and rank."""
    from hpc_ddp.watch.status import new_log_entries

    run = _one_run(job)
    offsets: dict[str, int] = _offsets(start) if start is not None else {}
    while True:
        running = follow and _status(run)["state"] in _FOLLOWED
        for entry in new_log_entries(run.run_dir, rank, offsets, whole_lines=running):  # srun wrote these: mask
            if start is not None:
                record = {**_log_record(entry.text), "path": entry.path, "end": entry.end, "part": entry.part,
                          "parts": entry.parts}
                click.echo(json.dumps(record))
            else:
                click.echo(json.dumps(_log_record(entry.text)) if as_json else entry.text)
        if not running:
            return
        time.sleep(1)


def _offsets(text: str) -> dict[str, int]:
    try:
        offsets = json.loads(text)
    except ValueError:
        offsets = None
    if not isinstance(offsets, dict) or not all(isinstance(v, int) and v >= 0 for v in offsets.values()):
        raise UserError("--from must be a JSON object of log paths and byte offsets")
    return {str(k): v for k, v in offsets.items()}


# The prefix `new_log_lines` puts on every line.
_LOG_PREFIX = re.compile(r"\[attempt (\d+) rank (\d+)\] ", re.ASCII)


def _log_record(line: str) -> dict:
    """`[attempt A rank R] text` -> the stable keys of `logs --json`."""
    found = _LOG_PREFIX.match(line)
    if found is None:  # not ours: keep the text, say nothing we do not know
        return {"attempt": None, "rank": None, "line": line}
    return {"attempt": int(found[1]), "rank": int(found[2]), "line": line[found.end():]}


@click.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.option("-n", "limit", type=click.IntRange(min=1), default=20, show_default=True, help="How many recent runs.")
def list_runs(as_json: bool, limit: int) -> None:
    """This user's recent runs, from any directory (newest last)."""
    from hpc_ddp.watch.registry import runs
    from hpc_ddp.watch.status import format_runs, with_accounting

    damaged: list = []
    records = with_accounting(runs(left_out=damaged)[-limit:], SubprocessCommands())
    if damaged:
        warn(f"warning: {len(damaged)} damaged line(s) of the run registry left out (a value of another type than "
             "hpc-ddp writes there)")
    if any(r.get("host") for r in records):  # submitted from here over ssh: their clusters say their state
        from hpc_ddp.remote.forward import with_remote_accounting

        records = with_remote_accounting(records)
    if as_json:
        click.echo(json.dumps(records, indent=2))
        return
    for line in format_runs(records):
        click.echo(printable(line))


@click.command()
@click.argument("job", required=False)
@click.option("-o", "--output", help="PNG to write [default: RUN_DIR/timeline.png].")
@over_ssh(how="picture")
def timeline(job: str | None, output: str | None) -> None:
    """Draw where JOB's wall-clock time went (a job id or a run dir; without JOB, the most recent run):
    queue waits, each attempt on its nodes, checkpoints, stops, requeues, resumes, steps redone, samples/s."""
    from hpc_ddp.watch.status import records, submitted_at
    from hpc_ddp.watch.timeline import build_timeline, draw, save_png, summarize, summary_line

    run = _one_run(job)
    run_dir = run.run_dir
    out = _png_output(output) or run.paths.picture("timeline")
    if out.parent == run_dir and not os.access(run_dir, os.W_OK):
        raise UserError(f"cannot write {str(out)!r}: the run dir is not writable", hint="give -o PNG")
    tl = build_timeline(records(run.paths.events), records(run.paths.metrics), submitted_at(run_dir))
    if not tl.spans:
        raise UserError(f"{run_dir} has no attempt or training records yet (events.jsonl)",
                        hint="give the run dir of a job that has started")
    line = summary_line(summarize(tl))
    try:
        save_png(draw(tl, f"{run_dir.name} (job {run.job_id or '-'}): {line}"), out)
    except OSError as exc:
        raise UserError(f"cannot write {str(out)!r}: {exc.strerror or exc}") from None
    click.echo(printable(line))
    from hpc_ddp.watch.status import start_over_lines_of

    for over in start_over_lines_of(run_dir, tl):
        click.echo(printable(over))
    click.echo(printable(f"Wrote {out}"))


@click.command()
@click.argument("run_dir")
@click.option("-o", "--output", help="PNG to write [default: RUN_DIR/training.png].")
@over_ssh("run_dir", how="picture")
def plot(run_dir: str, output: str | None) -> None:
    """Plot loss and accuracy over steps, with every stop and resume marked (RUN_DIR: a run dir, or the job id
    of a run submitted from here over ssh)."""
    from hpc_ddp.watch.plot import plot_run

    if not os.path.isdir(run_dir):
        why = "does not exist" if not os.path.lexists(run_dir) else "is a file, not a run dir"
        raise UserError(f"{run_dir!r} {why}", hint="give the run dir of a job (the path `hpc-ddp list` shows)")

    path = plot_run(Path(run_dir), _png_output(output))
    click.echo(f"Wrote {path}")


def _png_output(output: str | None) -> Path | None:
    """The -o path of plot and timeline, refused at once where it cannot be written."""
    out = Path(output).expanduser().resolve() if output else None
    if out is not None and (out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK)
                            or on_kernel_fs(out)):
        raise UserError(f"-o {output!r}: " + ("is a directory" if out.is_dir() else
                        f"{str(out.parent)!r} is not a directory you can write to"), hint="give a PNG file path")
    if out is not None and out.suffix.lower() != ".png":
        raise UserError(f"-o {output!r}: the picture is a PNG, and this name says otherwise",
                        hint=f"give a name ending in .png, e.g. -o {out.stem or 'picture'}.png")
    if out is not None and out.exists() and not out.is_file():
        raise UserError(f"-o {output!r}: is not a regular file, and is not replaced", hint="give a PNG file path")
    return out


COMMANDS = [status, logs, list_runs, timeline, plot]
