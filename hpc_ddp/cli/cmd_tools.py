"""train, env, stage, inspect, make-dataset: things done on this machine, in this process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from hpc_ddp.cli.options import build
from hpc_ddp.cli.remote import over_ssh
from hpc_ddp.common.errors import SpecError, UserError
from hpc_ddp.common.terminal import printable
from hpc_ddp.job.distenv import from_environ
from hpc_ddp.launch.rundirs import usable_run_dir
from hpc_ddp.launch.shellwords import bash_word


@click.command(context_settings={"allow_interspersed_args": False})
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
    from hpc_ddp.launch.executors.base import Plan, write_run_dir

    params = {"argv": (job_file,), "module": None, **{k: v for k, v in flags.items() if k != "run_dir"}}
    spec = build(params)
    if spec.target.kind != "trainer":
        raise SpecError(f"{job_file} runs {spec.target.describe()}, not the built-in trainer",
                        hint="use `hpc-ddp submit` for your own scripts")
    run_dir = Path(usable_run_dir(Path(flags["run_dir"] or spec.run_dir or Path(spec.workdir) / "runs" /
                                       spec.job_name).expanduser()))
    dist_env = from_environ(os.environ, pid=os.getpid())
    if dist_env.rank == 0:
        write_run_dir(Plan("direct", spec, str(run_dir), None, ""))
    from hpc_ddp.trainer import train as trainer

    sys.exit(trainer.run(spec, run_dir, dist_env))


@click.command("env")
@click.option("--json", "as_json", is_flag=True, help="Print the DistEnv as one JSON object.")
def env_cmd(as_json: bool) -> None:
    """Show the distributed environment this process would get (rank, world size, master, ...)."""
    dist = from_environ(os.environ, pid=os.getpid())
    if as_json:
        click.echo(json.dumps(dist.to_json()))
        return
    for key, value in dist.to_json().items():
        click.echo(printable(f"{key:17} {','.join(value) if isinstance(value, list) else value}"))


@click.command("stage")
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


@click.command()
@click.argument("checkpoint")
@click.option("--json", "as_json", is_flag=True)
@over_ssh("checkpoint")
def inspect(checkpoint: str, as_json: bool) -> None:
    """Verify a checkpoint (a step-N dir, a checkpoints dir or a run dir; or the job id of a run submitted
    from here over ssh) and show step, epoch, model hash."""
    from hpc_ddp.trainer.checkpoint import inspect_checkpoint

    info = _read_checkpoint(checkpoint, inspect_checkpoint)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for key in ("path", "step", "epoch", "batch_in_epoch", "model_sha256", "verified"):
        click.echo(printable(f"{key:15} {info[key]}"))
    click.echo(printable(f"{'code':15} {_code_of(info)}"))
    for name, meta in info["files"].items():
        click.echo(printable(f"  {name:20} {meta['size']:>12,} bytes  sha256 {meta['sha256'][:16]}..."))


def _read_checkpoint(given: str, read):
    """`read(path)` of the checkpoint, checkpoints dir or run dir the user named. A path that never held one
    (/etc, a file) is the user's slip, exit 2; a damaged checkpoint stays exit 1."""
    from hpc_ddp.trainer.checkpoint import CheckpointError

    path = Path(given)
    if not os.path.lexists(path):
        raise UserError(f"{given!r} does not exist", hint="give a run dir, its checkpoints/ dir or one step-N dir in it")
    try:
        return read(path)
    except CheckpointError:
        if _holds_checkpoints(path):
            raise
        raise UserError(f"{given!r} is not a checkpoint, a checkpoints dir or a run dir",
                        hint="give a run dir, its checkpoints/ dir or one step-N dir in it") from None


def _code_of(info: dict) -> str:
    """The snapshot that saved the checkpoint, described from its run dir's records where they are there."""
    from hpc_ddp.common.rundir import RunDir
    from hpc_ddp.watch.status import code_line, records, snapshots_of

    if not info.get("code"):
        return "not recorded (saved without a code snapshot)"
    run_dir = Path(info["path"]).parent.parent  # RUN_DIR/checkpoints/step-N
    return code_line(info["code"], snapshots_of(records(RunDir(run_dir).events))).removeprefix("code ")


def _holds_checkpoints(path: Path) -> bool:
    from hpc_ddp.common.rundir import CHECKPOINT_PREFIX, LATEST, RunDir
    from hpc_ddp.trainer.checkpoint import MANIFEST

    return path.is_dir() and ((path / MANIFEST).exists() or (path / LATEST).exists() or
                              RunDir(path).checkpoints.is_dir() or any(path.glob(f"{CHECKPOINT_PREFIX}*")))


@click.command("export")
@click.argument("run")
@click.option("--to", "to", required=True, help="The file to write (it must not exist yet).")
@click.option("--step", type=click.IntRange(min=0), help="The checkpoint of this step [default: the newest that verifies].")
@click.option("--json", "as_json", is_flag=True)
def export_cmd(run: str, to: str, step: int | None, as_json: bool) -> None:
    """Write a checkpoint's model as one file that torch.load reads into the unsharded model (for inference or
    to publish the weights): a sharded (FSDP) checkpoint's shards put together, or a DDP one's model.pt. RUN is
    a run dir, its checkpoints dir or one step-N dir. CPU only; verified first; never replaces a file.

    \b
      hpc-ddp export runs/gpt-20261202-0940 --to gpt.pt
      model = GPT(config); model.load_state_dict(torch.load("gpt.pt"))
    """
    from hpc_ddp.trainer.export import export_model

    target = Path(to)
    if os.path.lexists(target):
        raise UserError(f"{to} exists; export never replaces a file", hint="give --to a new path, or move that one away")
    if not target.parent.is_dir():
        raise UserError(f"{target.parent} is not a directory", hint=f"mkdir -p {bash_word(str(target.parent))}")
    info = _read_checkpoint(run, lambda source: export_model(source, target, step))
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(printable(f"wrote {info['path']}: the model of {info['checkpoint']} (step {info['step']}), "
                         f"{info['tensors']} tensors, {info['bytes']:,} bytes, sha256 of its state "
                         f"{info['model_sha256'][:16]}... (as hpc-ddp inspect shows it)"))


@click.command("make-dataset")
@click.argument("kind", type=click.Choice(["mnist", "imagefolder", "cifar10", "tokens"]))
@click.argument("root", type=click.Path(file_okay=False))
@click.option("--train", "n_train", type=click.IntRange(1, 10_000_000),
              help="Training samples (imagefolder: per class; tokens: tokens).")
@click.option("--test", "n_test", type=click.IntRange(1, 10_000_000),
              help="Test/validation samples (imagefolder: per class).")
@click.option("--seed", type=click.IntRange(0, 2**31 - 1), default=0, show_default=True)
@click.option("--size", type=click.IntRange(8, 4096), help="imagefolder: the images' side in pixels [default: 32].")
@click.option("--jpeg", is_flag=True, help="imagefolder: JPEG files (what the GPU data path decodes), not PNG.")
def make_dataset(kind: str, root: str, n_train: int | None, n_test: int | None, seed: int, size: int | None,
                 jpeg: bool) -> None:
    """Write a small learnable dataset in a real format (MNIST IDX, ImageFolder PNGs or JPEGs, CIFAR-10
    batches, or nanoGPT's uint16 token files for the gpt model)."""
    from hpc_ddp.data.datagen import GENERATORS

    if kind != "imagefolder" and (size is not None or jpeg):
        raise UserError("--size and --jpeg are for imagefolder datasets", hint="leave them out for " + kind)
    sizes = {"imagefolder": ("per_class_train", "per_class_val")}.get(kind, ("train", "test"))
    kwargs = {name: value for name, value in zip(sizes, (n_train, n_test)) if value is not None}
    kwargs.update({"size": size} if size is not None else {}, **({"image_format": "jpeg"} if jpeg else {}))
    path = GENERATORS[kind](root, seed=seed, **kwargs)
    click.echo(f"Wrote the {kind} dataset to {path}")


COMMANDS = [train, env_cmd, stage_cmd, inspect, export_cmd, make_dataset]
