"""The `hpc-ddp` command. Thin: parse, build the spec, call the executor, print. Errors are translated
once, here: a UserError prints one line and exits 2, any other HpcDdpError exits 1 with its cause.
Importing this module must stay fast: no torch, no submitit at import time.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shlex
import sys
from pathlib import Path

import click

from hpc_ddp import __version__
from hpc_ddp.spec.config import is_job_file, job_file_layer, profile_layer, profiles_path, resolve_target
from hpc_ddp.job.distenv import from_environ
from hpc_ddp.common.errors import HpcDdpError, SpecError, UserError
from hpc_ddp.launch.executors import choose_executor, get_executor
from hpc_ddp.common.procs import SubprocessCommands
from hpc_ddp.spec.jobspec import JobSpec, Layer, Target, build_spec
from hpc_ddp.common.rundir import RunDir


class Cli(click.Group):
    """A click group that turns our errors (and click's usage errors) into one line and an exit code."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name or "hpc-ddp", complete_var, standalone_mode=False, **extra)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            _fail(exc.format_message(), 2)
        except click.Abort:
            _fail("aborted", 130)
        except UserError as exc:
            _fail(str(exc), exc.exit_code)
        except HpcDdpError as exc:
            _fail(str(exc), exc.exit_code)
        except Exception as exc:  # a bug of ours: say what broke, keep the traceback for who asks
            if os.environ.get("HPC_DDP_DEBUG"):
                raise
            _fail(f"internal error: {type(exc).__name__}: {exc} (set HPC_DDP_DEBUG=1 for the traceback)", 1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _fail(message: str, code: int) -> None:
    from hpc_ddp.common import secrets

    # A spec error or sbatch's stderr may quote a value the user typed.
    click.echo(f"hpc-ddp: error: {secrets.current()(message)}", err=True)
    sys.exit(code)


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hpc-ddp")
def cli() -> None:
    """Run PyTorch DDP training on Slurm: nodes x GPUs, a correct torch.distributed environment on every
    rank, and the exact batch script shown before anything queues."""


# ---- options shared by submit and render, defined once ----

_SPEC_OPTIONS = [
    click.option("--nodes", help="Number of nodes."),
    click.option("--gpus", help="GPUs per node."),
    click.option("--tasks-per-node", help="Ranks per node [default: the GPU count, or 1]."),
    click.option("--cpus-per-task", help="CPUs per rank (data loader workers need them)."),
    click.option("--mem", help="Memory per node, e.g. 64G (0: all of it)."),
    click.option("--time", help="Time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."),
    click.option("--partition"), click.option("--account"), click.option("--qos"), click.option("--constraint"),
    click.option("--job-name"),
    click.option("--profile", help="A cluster profile from the profiles file (HPC_DDP_PROFILES)."),
    click.option("--executor", type=click.Choice(["sbatch", "submitit", "local"]),
                 help="[default: sbatch where Slurm's commands exist, else local, for what this machine "
                      "can hold]"),
    click.option("--run-dir", help="Where logs, checkpoints and the script go [default: ./runs/NAME-TIME]."),
    click.option("--sbatch-arg", "sbatch_args", multiple=True, help="Extra sbatch option, e.g. --sbatch-arg=--exclusive."),
    click.option("--gpu-bind", type=click.Choice(["rank", "node"]),
                 help="rank: each rank sees only its GPU (cuda:0); node: every rank sees the node's GPUs."),
    click.option("--signal", help="Warning signal before the time limit [default: USR2]."),
    click.option("--signal-lead", help="Seconds before the time limit to send it [default: 120]."),
    click.option("--max-requeues", help="Requeues after time limits [default: 10]."),
    click.option("--max-preemptions", help="Requeues after preemptions [default: 20]."),
    click.option("--epochs"), click.option("--lr"), click.option("--batch-size"),
    click.option("--master-port",
                 help="Port rank 0 listens on for the rendezvous [default: derived from the job id]."),
    click.option("--rendezvous-timeout", help="Seconds the ranks wait for each other at start-up [default: 300]."),
    click.option("--collective-timeout",
                 help="Seconds a collective may block before the ranks give up [default: 600]."),
    click.option("--pass-local-rank", is_flag=True, default=None,
                 help="Append --local_rank=N to the script's arguments (torch.distributed.launch style)."),
    click.option("--stage", "datasets", multiple=True, metavar="SRC[:NAME]",
                 help="Copy a dataset (dir, .tar[.gz], .zip) to node-local disk before training (repeatable)."),
    click.option("-m", "module", help="Run a module (like python -m) instead of a script."),
    click.argument("argv", nargs=-1, type=click.UNPROCESSED),
]


def spec_options(fn):
    for option in reversed(_SPEC_OPTIONS):
        fn = option(fn)
    return fn


_NOT_SPEC = ("argv", "module", "dry_run", "as_json", "no_preflight")


def _build(params: dict, default_target: Target | None = None) -> JobSpec:
    argv = list(params["argv"])
    module = params["module"]
    cwd = Path.cwd()
    head, args = (None, argv) if module else (argv[0] if argv else None, argv[1:])
    args = args[1:] if args[:1] == ["--"] else args
    flags = {k: v for k, v in params.items() if k not in _NOT_SPEC and v not in (None, ())}
    if "datasets" in flags:  # --stage paths are relative to where the command runs
        flags["datasets"] = [_abs_stage(item, cwd) for item in flags["datasets"]]
    layers: list[Layer] = []
    if head and is_job_file(head):
        job_path = (cwd / head).resolve()
        job_layer = job_file_layer(job_path)
        target = _job_target(job_layer, job_path, tuple(args), cwd)
        job_values = {k: v for k, v in job_layer.values.items() if k not in ("script", "module", "args")}
        layers.append(Layer(job_layer.origin, job_values, job_layer.allowed))
    elif default_target is not None and not (head or module):
        target = default_target
    else:
        target = resolve_target(head, module, tuple(args), cwd)
    profile = flags.get("profile") or next((ly.values.get("profile") for ly in layers), None) \
        or os.environ.get("HPC_DDP_PROFILE")
    if profile:
        layers.insert(0, profile_layer(str(profile), profiles_path(os.environ)))
        flags.setdefault("profile", profile)
    layers.append(Layer("command line", flags, is_cli=True))
    return build_spec(layers, target=target, workdir=str(cwd), python=sys.executable)



def _abs_stage(item: str, cwd: Path) -> str:
    src, sep, name = item.rpartition(":") if ":" in item else (item, "", "")
    src = src if sep else item
    resolved = str((cwd / src).resolve()) if not os.path.isabs(src) else src
    return f"{resolved}:{name}" if sep else resolved


def _job_target(layer: Layer, job_path: Path, extra_args: tuple[str, ...], cwd: Path) -> Target:
    values = layer.values
    if not isinstance(values.get("args", []), list):
        raise SpecError(f"{layer.origin}: args must be a list of strings")
    args = tuple(values.get("args", ())) + extra_args
    if values.get("script") or values.get("module"):
        return resolve_target(values.get("script"), values.get("module"), args, cwd)
    if "train" in values:
        if extra_args:
            raise SpecError(f"{' '.join(extra_args)!r} after the job file would be ignored by the built-in trainer",
                            hint="put options before the job file: hpc-ddp submit --nodes 2 JOB.toml")
        return Target("trainer", str(job_path), tuple(values.get("args", ())))
    raise SpecError(f"{layer.origin} names nothing to run",
                    hint="add script = \"train.py\", module = \"pkg.train\" or a [train] table to it")


def _register(spec: JobSpec, run_dir: str, job_id: str, executor: str) -> None:
    from hpc_ddp.launch.registry import register

    try:
        register({"job_id": job_id, "executor": executor, "run_dir": run_dir, "name": spec.job_name,
                  "nodes": spec.nodes, "gpus": spec.gpus})
    except OSError as exc:  # a read-only home must not stop a submission
        click.echo(f"hpc-ddp: warning: could not record the run in the registry: {exc}", err=True)


def _run_dir(spec: JobSpec, now: _dt.datetime) -> str:
    if spec.run_dir:
        return _usable_run_dir(Path(spec.run_dir).expanduser())
    base = Path(spec.workdir) / "runs" / f"{spec.job_name}-{now:%Y%m%d-%H%M%S}"
    candidate, n = base, 1
    while candidate.exists():  # two submissions in one second (a sweep loop) must not share a run dir
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return _usable_run_dir(candidate)


_VIRTUAL_FS = ("/proc", "/sys", "/dev")


def _usable_run_dir(path: Path) -> str:
    """The absolute run dir, if it is (or can be made as) a directory of ours: checked before anything is
    written or rendered, so a dry run says what the submission would, and a bad path is one line, exit 2."""
    try:
        path = path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        why = getattr(exc, "strerror", None) or exc
        raise UserError(f"run dir {str(path)!r} cannot be resolved: {why}") from None
    shown = str(path) if len(str(path)) <= 100 else str(path)[:97] + "..."
    if any(len(part.encode()) > 255 for part in path.parts) or len(str(path).encode()) >= 4096:
        raise UserError(f"run dir {shown!r} has a name longer than the filesystem allows (255 bytes a name)",
                        hint="use a shorter --job-name or --run-dir")
    if _on_kernel_fs(path):
        raise UserError(f"run dir {shown!r} is on a kernel filesystem, not a place for files",
                        hint="give a --run-dir in your home, project or scratch space")
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing.is_file() else "exists and is not a directory"
        where = "" if existing == path else f", so the run dir {shown!r} cannot be made under it"
        raise UserError(f"{str(existing)!r} {what}{where}", hint="give --run-dir a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"run dir {shown!r} cannot be written: {str(existing)!r} is not writable by you",
                        hint="give a --run-dir where you can write")
    return str(path)


def _on_kernel_fs(path: Path) -> bool:
    """Under /proc, /sys or /dev (but /dev/shm): writing there fails or does something else than a file."""
    def under(top: str) -> bool:
        return path == Path(top) or Path(top) in path.parents
    return any(under(top) for top in _VIRTUAL_FS) and not under("/dev/shm")


def _existing_run_dir(run_dir: Path, ref: str) -> Path:
    """A run dir hpc-ddp made: a directory with its spec.json. Anything else is named, exit 2."""
    try:
        is_dir = run_dir.is_dir()
        has_spec = is_dir and RunDir(run_dir).spec.is_file()
    except OSError as exc:
        raise UserError(f"cannot read run dir {str(run_dir)!r}: {exc.strerror or exc}") from None
    if not is_dir:
        raise UserError(f"the run dir of {ref!r}, {str(run_dir)!r}, no longer exists",
                        hint="`hpc-ddp list` shows the recorded runs; scancel still takes a Slurm job id")
    if not has_spec:
        raise UserError(f"{str(run_dir)!r} is not a run dir (it has no spec.json)",
                        hint="give a run dir hpc-ddp made (runs/NAME-TIME), or a job id from `hpc-ddp list`")
    return run_dir


def _executor_for(spec: JobSpec, quiet: bool):
    commands = SubprocessCommands()
    name, why = choose_executor(spec.executor, commands.which("sbatch") is not None)
    if name == "local" and not spec.executor:
        _refuse_unasked_local(spec)
    if not quiet or not spec.executor:
        click.echo(f"hpc-ddp: executor {name} ({why})", err=True)
    now = _dt.datetime.now()
    command_line = shlex.join(["hpc-ddp", *sys.argv[1:]]) if sys.argv else "hpc-ddp"
    executor = get_executor(name, commands=commands, generated_at=now.isoformat(timespec="seconds"),
                            command_line=command_line) if name == "sbatch" else get_executor(name)
    return executor, now


def _refuse_unasked_local(spec: JobSpec) -> None:
    """The implicit fallback (no --executor, no sbatch) runs only what this machine can hold: a user who
    forgot `module load slurm` must not start 8 training processes on a shared login node."""
    from hpc_ddp.launch import executors  # looked up at call time, so tests can fake the machine

    refusal = executors.refuse_fallback(spec, executors.probe_machine())
    if refusal is not None:
        raise refusal


@cli.command(context_settings={"allow_interspersed_args": False})
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
    spec = _build(params)
    executor, now = _executor_for(spec, quiet=params["as_json"])
    plan = executor.plan(spec, _run_dir(spec, now))
    if params["dry_run"]:
        if params["as_json"]:
            click.echo(json.dumps({"executor": plan.executor, "job_id": None, "run_dir": plan.run_dir,
                                   "script": plan.dry_run_text(), "dry_run": True}, indent=2))
        else:
            click.echo(plan.dry_run_text(), nl=False)
        return
    if executor.name != "local" and not params["no_preflight"]:
        _preflight(plan)
    if executor.name == "local":
        _register(spec, plan.run_dir, executor.job_id, "local")  # before it runs: it may run for hours
    sub = executor.submit(plan)
    if sub.executor != "local":
        _register(spec, sub.run_dir, sub.job_id, sub.executor)
    if params["as_json"]:
        click.echo(json.dumps(sub.to_json(), indent=2))
    elif sub.executor == "local":
        click.echo(f"hpc-ddp: local job {sub.job_id} {sub.state.lower()} (exit code {sub.returncode}); "
                   f"run dir {sub.run_dir}", err=True)
        if sub.state == "CHECKPOINTED":
            click.echo("hpc-ddp: submit it again with the same --run-dir to resume", err=True)
    else:
        click.echo(f"Submitted job {sub.job_id} ({sub.executor}); run dir {sub.run_dir}")
    if sub.returncode:
        sys.exit(1)


def _preflight(plan) -> None:
    """Warnings are printed and the submission goes on; errors stop it before anything queues."""
    from hpc_ddp.launch.preflight import Host, job_paths, run_preflight

    report = run_preflight(plan.spec, SubprocessCommands(), Host.current(), paths=job_paths(plan.spec, plan.run_dir))
    for finding in report.findings:
        if finding.level == "warning" or finding in report.errors[:-1]:
            click.echo(f"hpc-ddp: {finding.line()}", err=True)
    if report.errors:
        # The last error is the exit line, so a single problem reads as one line like any other user error.
        last = report.errors[-1]
        more = f" (and {len(report.errors) - 1} more above)" if len(report.errors) > 1 else ""
        raise UserError(f"{last.message}{more}; nothing was submitted",
                        hint=f"{last.hint + '; or ' if last.hint else ''}skip these checks with --no-preflight")


@cli.command(context_settings={"allow_interspersed_args": False})
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
    from hpc_ddp.slurm.cluster import format_cluster
    from hpc_ddp.launch.preflight import NO_TARGET, Host, Report, check, check_fallback, job_paths, run_preflight
    from hpc_ddp.launch.render import render_sbatch

    spec, commands, host = _build(params, default_target=NO_TARGET), SubprocessCommands(), Host.current()
    name, why = choose_executor(spec.executor, commands.which("sbatch") is not None)
    if name == "local":  # nothing queues: only the shell matters, and this machine when not asked for
        from hpc_ddp.launch import executors

        here = [] if spec.executor else check_fallback(spec, executors.probe_machine())
        report = Report(None, tuple(here + check(spec, None, host)))
    else:
        run_dir = _run_dir(spec, _dt.datetime.now())
        script = render_sbatch(spec, run_dir, generated_at="", command_line="hpc-ddp doctor")
        report = run_preflight(spec, commands, host, paths=job_paths(spec, run_dir), test_script=script)
    if params["as_json"]:
        click.echo(json.dumps({"executor": name, **report.to_json()}, indent=2))
    else:
        lines = [f"executor {name} ({why})", *(format_cluster(report.cluster) if report.cluster else [])]
        click.echo("\n".join(lines + [finding.line() for finding in report.findings]))
    sys.exit(2 if report.errors else 0)


@cli.command(context_settings={"allow_interspersed_args": False})
@spec_options
@click.option("--stdout", "to_stdout", is_flag=True, help="Print the script instead of writing the run dir.")
def render(to_stdout: bool, **params) -> None:
    """Write the sbatch script (and spec) into the run dir without submitting it."""
    from hpc_ddp.launch.executors.base import write_run_dir

    spec = _build({**params, "executor": "sbatch"})
    executor, now = _executor_for(spec, quiet=True)
    plan = executor.plan(spec, _run_dir(spec, now))
    if to_stdout:
        click.echo(plan.script, nl=False)
        return
    run_dir = write_run_dir(plan)
    script = RunDir(run_dir).script
    script.write_text(plan.script or "")
    click.echo(f"Wrote {script}; submit it with: cd {shlex.quote(str(run_dir))} && sbatch {script.name}")


@cli.command("env")
@click.option("--json", "as_json", is_flag=True, help="Print the DistEnv as one JSON object.")
def env_cmd(as_json: bool) -> None:
    """Show the distributed environment this process would get (rank, world size, master, ...)."""
    dist = from_environ(os.environ, pid=os.getpid())
    if as_json:
        click.echo(json.dumps(dist.to_json()))
        return
    for key, value in dist.to_json().items():
        click.echo(f"{key:17} {','.join(value) if isinstance(value, list) else value}")


@cli.command(context_settings={"allow_interspersed_args": False})
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--run-dir", help="Where checkpoints, metrics and events go [default: ./runs/JOB_NAME].")
@click.option("--epochs")
@click.option("--lr")
@click.option("--batch-size")
def train(job_file: str, **flags) -> None:
    """Run the built-in trainer for JOB_FILE in this process: alone, under torchrun, or in an srun step.

    Every rank of one run must use the same --run-dir (the default has no timestamp for that reason):
    a rerun with the same run dir resumes from its newest valid checkpoint.
    """

    params = {"argv": (job_file,), "module": None, **{k: v for k, v in flags.items() if k != "run_dir"}}
    spec = _build(params)
    if spec.target.kind != "trainer":
        raise SpecError(f"{job_file} runs {spec.target.describe()}, not the built-in trainer",
                        hint="use `hpc-ddp submit` for your own scripts")
    run_dir = Path(_usable_run_dir(Path(flags["run_dir"] or spec.run_dir or Path(spec.workdir) / "runs" /
                                        spec.job_name).expanduser()))
    dist_env = from_environ(os.environ, pid=os.getpid())
    if dist_env.rank == 0:
        _write_spec(spec, run_dir)
    from hpc_ddp.trainer import train as trainer

    sys.exit(trainer.run(spec, run_dir, dist_env))


def _write_spec(spec: JobSpec, run_dir: Path) -> None:
    from hpc_ddp.launch.executors.base import Plan, write_run_dir

    write_run_dir(Plan("direct", spec, str(run_dir), None, ""))


@cli.command()
@click.argument("checkpoint", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True)
def inspect(checkpoint: str, as_json: bool) -> None:
    """Verify a checkpoint (a step-N dir, a checkpoints dir or a run dir) and show step, epoch, model hash."""
    from hpc_ddp.common.rundir import CHECKPOINT_PREFIX, LATEST
    from hpc_ddp.trainer.checkpoint import MANIFEST, CheckpointError, inspect_checkpoint

    path = Path(checkpoint)
    try:
        info = inspect_checkpoint(path)
    except CheckpointError:
        # A damaged checkpoint stays exit 1; a path that never held one (/etc, a file) is the user's slip.
        ours = path.is_dir() and ((path / MANIFEST).exists() or (path / LATEST).exists() or
                                  RunDir(path).checkpoints.is_dir() or any(path.glob(f"{CHECKPOINT_PREFIX}*")))
        if ours:
            raise
        raise UserError(f"{checkpoint!r} is not a checkpoint, a checkpoints dir or a run dir",
                        hint="give a run dir, its checkpoints/ dir or one step-N dir in it") from None
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for key in ("path", "step", "epoch", "batch_in_epoch", "model_sha256", "verified"):
        click.echo(f"{key:15} {info[key]}")
    for name, meta in info["files"].items():
        click.echo(f"  {name:20} {meta['size']:>12,} bytes  sha256 {meta['sha256'][:16]}...")


@cli.command("make-dataset")
@click.argument("kind", type=click.Choice(["mnist", "imagefolder", "cifar10"]))
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--train", "n_train", type=click.IntRange(1, 10_000_000),
              help="Training samples (imagefolder: per class).")
@click.option("--test", "n_test", type=click.IntRange(1, 10_000_000),
              help="Test/validation samples (imagefolder: per class).")
@click.option("--seed", type=click.IntRange(0, 2**31 - 1), default=0, show_default=True)
def make_dataset(kind: str, root: str, n_train: int | None, n_test: int | None, seed: int) -> None:
    """Write a small learnable dataset in a real format (MNIST IDX, ImageFolder PNGs, CIFAR-10 batches)."""
    from hpc_ddp.data.datagen import GENERATORS

    sizes = {"imagefolder": ("per_class_train", "per_class_val")}.get(kind, ("train", "test"))
    kwargs = {name: value for name, value in zip(sizes, (n_train, n_test)) if value is not None}
    path = GENERATORS[kind](root, seed=seed, **kwargs)
    click.echo(f"Wrote the {kind} dataset to {path}")


@cli.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", help="PNG to write [default: RUN_DIR/training.png].")
def plot(run_dir: str, output: str | None) -> None:
    """Plot loss and accuracy over steps, with every stop and resume marked."""
    from hpc_ddp.launch.plot import plot_run

    path = plot_run(Path(run_dir), _png_output(output))
    click.echo(f"Wrote {path}")


@cli.command()
@click.argument("job", required=False)
@click.option("-o", "--output", help="PNG to write [default: RUN_DIR/timeline.png].")
def timeline(job: str | None, output: str | None) -> None:
    """Draw where JOB's wall-clock time went (a job id or a run dir; without JOB, the most recent run):
    queue waits, each attempt on its nodes, checkpoints, stops, requeues, resumes, steps redone, samples/s."""
    from hpc_ddp.launch.status import _submitted, records
    from hpc_ddp.launch.timeline import build_timeline, draw, save_png, summarize, summary_line

    run_dir, job_id, _ = _resolve(job)
    out = _png_output(output) or RunDir(run_dir).picture("timeline")
    if out.parent == run_dir and not os.access(run_dir, os.W_OK):
        raise UserError(f"cannot write {str(out)!r}: the run dir is not writable", hint="give -o PNG")
    tl = build_timeline(records(RunDir(run_dir).events), records(RunDir(run_dir).metrics), _submitted(run_dir))
    if not tl.spans:
        raise UserError(f"{run_dir} has no attempt or training records yet (events.jsonl)",
                        hint="give the run dir of a job that has started")
    line = summary_line(summarize(tl))
    try:
        save_png(draw(tl, f"{run_dir.name} (job {job_id or '-'}): {line}"), out)
    except OSError as exc:
        raise UserError(f"cannot write {str(out)!r}: {exc.strerror or exc}") from None
    click.echo(line)
    click.echo(f"Wrote {out}")


def _png_output(output: str | None) -> Path | None:
    """The -o path of plot and timeline, refused at once where it cannot be written."""
    out = Path(output).expanduser().resolve() if output else None
    if out is not None and (out.is_dir() or not out.parent.is_dir() or not os.access(out.parent, os.W_OK)
                            or _on_kernel_fs(out)):
        raise UserError(f"-o {output!r}: " + ("is a directory" if out.is_dir() else
                        f"{str(out.parent)!r} is not a directory you can write to"), hint="give a PNG file path")
    return out


@cli.command("stage")
@click.argument("src", type=click.Path(exists=True))
@click.option("--dest", help="Node-local directory to stage into [default: $SLURM_TMPDIR, else $TMPDIR, else /tmp].")
@click.option("--name", help="Name of the staged copy [default: the source's name].")
@click.option("--checksums", is_flag=True, help="Verify sha256 of every file, not only sizes.")
def stage_cmd(src: str, dest: str | None, name: str | None, checksums: bool) -> None:
    """Copy or extract a dataset to node-local disk, once per node, verified (what jobs do before training)."""
    from hpc_ddp.data.staging import stage

    scratch = dest or os.environ.get("SLURM_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    result = stage(src, Path(scratch) / "hpc-ddp-datasets" if not dest else Path(dest), name=name,
                   checksums=checksums, log=lambda m: click.echo(m, err=True))
    click.echo(str(result.path))


# ---- watching and managing ----

@cli.command()
@click.argument("job", required=False)
@click.option("--json", "as_json", is_flag=True)
@click.option("-w", "--watch", is_flag=True, help="Print step, samples/s and ETA every --interval seconds until "
                                                  "the job ends (Ctrl-C stops watching, not the job).")
@click.option("--interval", type=click.FloatRange(0.2, 3600), default=5.0, show_default=True,
              help="Seconds between --watch lines.")
def status(job: str | None, as_json: bool, watch: bool, interval: float) -> None:
    """State, restarts, last checkpoint, progress, ETA, where the time went and last event of JOB (a job
    id or a run dir); without JOB, the most recent run."""
    import time

    from hpc_ddp.launch.status import LIVE, format_status, progress_line, run_status

    run_dir, job_id, executor = _resolve(job)
    info = run_status(run_dir, job_id, executor, SubprocessCommands())
    try:
        while watch and info["state"] in LIVE:
            click.echo(progress_line(info, time.time()))
            time.sleep(interval)
            info = run_status(run_dir, job_id, executor, SubprocessCommands())
    except KeyboardInterrupt:  # stop watching; the job goes on
        click.echo("")
        return
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    for line in format_status(info):
        click.echo(line)


@cli.command()
@click.argument("job", required=False)
@click.option("--rank", type=int, help="Only this rank.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines while the job runs.")
def logs(job: str | None, rank: int | None, follow: bool) -> None:
    """Every rank's log across all attempts, each line prefixed by attempt and rank."""
    import time

    from hpc_ddp.launch.status import new_log_lines

    run_dir, job_id, executor = _resolve(job)
    offsets: dict[str, int] = {}
    while True:
        running = follow and _still_running(run_dir, job_id, executor)
        for line in new_log_lines(run_dir, rank, offsets, whole_lines=running):  # srun wrote these: mask
            click.echo(line)
        if not running:
            return
        time.sleep(1)


def _still_running(run_dir: Path, job_id: str | None, executor: str | None) -> bool:
    from hpc_ddp.launch.status import run_status

    return run_status(run_dir, job_id, executor, SubprocessCommands())["state"] in ("RUNNING", "PENDING",
                                                                                    "CONFIGURING", "COMPLETING")


@cli.command()
@click.argument("job")
def cancel(job: str) -> None:
    """Cancel JOB (a job id or a run dir): scancel on Slurm, or stop the local executor (its ranks
    checkpoint first; it is not restarted)."""
    import signal as _signal

    from hpc_ddp.common.events import JsonLines

    run_dir, job_id, executor = _resolve(job)
    if executor == "local":
        if _local_cancel_pending(run_dir, job_id):
            # Again: a second SIGINT would kill ranks that are still saving. Ctrl-C twice does that.
            who = _local_executor(run_dir)
            click.echo(f"hpc-ddp: job {job_id} is already being cancelled; waiting for it", err=True)
        else:
            who = _signal_local(run_dir, _signal.SIGINT)
            JsonLines(RunDir(run_dir).events).write({"event": "cancelled", "job_id": job_id, "by": "hpc-ddp cancel"})
        if not _wait_gone(who, 60):
            click.echo(f"Asked job {job_id} to stop ({run_dir}); its ranks are still checkpointing")
            return
    else:
        _scancel([job_id or job])
        JsonLines(RunDir(run_dir).events).write({"event": "cancelled", "job_id": job_id, "by": "hpc-ddp cancel"})
    click.echo(f"Cancelled job {job_id} ({run_dir})")


def _local_cancel_pending(run_dir: Path, job_id: str | None) -> bool:
    """`hpc-ddp cancel` already signalled this run of the job (since its latest first attempt)."""
    from hpc_ddp.common.events import read_jsonl
    from hpc_ddp.launch.status import _current_job

    return any(e.get("event") == "cancelled" and e.get("job_id") == job_id
               for e in _current_job(read_jsonl(RunDir(run_dir).events)))


def _wait_gone(who, timeout: float) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while who.alive():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@cli.command()
@click.argument("job")
@click.option("--signal", "sig", help="Signal to send [default: the job's warning signal, e.g. USR2].")
def preempt(job: str, sig: str | None) -> None:
    """Rehearse a preemption: send the warning signal to every rank of JOB (local or Slurm). The ranks
    checkpoint at the next step and the job requeues itself."""
    import signal as _signal

    from hpc_ddp.spec.jobspec import load_spec

    run_dir, job_id, executor = _resolve(job)
    from hpc_ddp.spec.jobspec import SIGNALS

    name = (sig or load_spec(RunDir(run_dir).spec).signal).upper().removeprefix("SIG")
    if name not in SIGNALS:
        raise UserError(f"--signal {sig!r} is not one of {', '.join(SIGNALS)}")
    if executor == "local":
        _signal_local(run_dir, getattr(_signal, f"SIG{name}"))
    else:
        _scancel(["--signal", name, job_id or job])
    click.echo(f"Sent SIG{name} to every rank of job {job_id}")


def _local_executor(run_dir: Path):
    """The executor process that local.pid names, checked to be that very process (its start time and
    command line), never a process that took its pid later."""
    from hpc_ddp.common.procs import read_pid_file

    who, _, why = read_pid_file(RunDir(run_dir).local_pid)
    if who is None:
        raise UserError(f"no local job is running for {run_dir} ({why})")
    return who


def _signal_local(run_dir: Path, signum: int):
    from hpc_ddp.common.procs import signal_process

    who = _local_executor(run_dir)
    if not signal_process(who, signum):
        raise UserError(f"no local job is running for {run_dir} (process {who.pid} has just ended)")
    return who


def _scancel(args: list[str]) -> None:
    done = SubprocessCommands().run(["scancel", *args], timeout=30)
    if done.returncode != 0:
        raise UserError(f"scancel {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")


@cli.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.option("-n", "limit", type=int, default=20, show_default=True, help="How many recent runs.")
def list_runs(as_json: bool, limit: int) -> None:
    """This user's recent runs, from any directory (newest last)."""
    from hpc_ddp.launch.registry import runs
    from hpc_ddp.launch.status import accounting

    records = [r for r in runs() if isinstance(r, dict)][-limit:]
    # Slurm jobs' state, elapsed time and exit code from accounting, in one sacct call (none without it).
    slurm_ids = [str(r["job_id"]) for r in records if r.get("executor") in ("sbatch", "submitit")
                 and str(r.get("job_id", "")).isdigit()]
    acct = accounting(slurm_ids, SubprocessCommands())
    for r in records:
        last = (acct.get(str(r.get("job_id"))) or [None])[-1]
        if last:
            r["slurm"] = {"state": last["state"], "elapsed": last["elapsed"], "exit_code": last["exitcode"]}
    if as_json:
        click.echo(json.dumps(records, indent=2))
        return
    if not records:
        click.echo("no runs yet")
    for r in records:
        slurm = r.get("slurm") or {}
        click.echo(f"{str(r.get('job_id')):28} {r.get('executor', '?'):8} {slurm.get('state', '-'):10} "
                   f"{slurm.get('elapsed', '-'):>10} {r.get('name', ''):20} {r.get('run_dir')}")


def _resolve(job: str | None) -> tuple[Path, str | None, str | None]:
    from hpc_ddp.launch.registry import find_run, runs

    if job is None:
        recent = runs()
        if not recent:
            raise UserError("no runs recorded yet", hint="give a job id or a run dir")
        job = recent[-1]["run_dir"]
    run_dir, job_id, executor = find_run(job)
    return _existing_run_dir(Path(run_dir), job), job_id, executor


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
