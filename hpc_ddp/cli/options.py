"""The job options that submit, render and doctor share (defined once), and the spec they build: the
command line handed to `spec.config.spec_from_command`, which owns the layering and its precedence.
Also the executor a command gets, said on stderr as it is chosen.
"""

from __future__ import annotations

import datetime as _dt
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import click

from hpc_ddp.common import verbosity
from hpc_ddp.common.procs import SubprocessCommands
from hpc_ddp.launch.executors import NAMES, get_executor, resolve_executor
from hpc_ddp.slurm.helptext import BrokenTool, installed_options
from hpc_ddp.spec.config import spec_from_command
from hpc_ddp.spec.interpreter import choose
from hpc_ddp.spec.jobspec import JobSpec, Layer, Target
from hpc_ddp.spec.slurmargs import SBATCH, SRUN, unlisted

__all__ = ["spec_options", "build", "executor_for", "warn"]

_SPEC_OPTIONS = [
    click.option("--nodes", help="Number of nodes, or a range MIN-MAX: the job starts on as many as Slurm gives "
                                 "(at least MIN), and a requeued job resumes on however many it then gets."),
    click.option("--elastic", type=click.Choice(["keep_global_batch", "keep_per_rank_batch"]),
                 help="With --nodes MIN-MAX, a resume on another number of nodes keeps the global batch (by gradient "
                      "accumulation) [default], or the per-rank batch (the global batch changes with the size)."),
    click.option("--gpus", help="GPUs per node."),
    click.option("--tasks-per-node", help="Ranks per node [default: the GPU count, or 1]."),
    click.option("--cpus-per-task", help="CPUs per rank (data loader workers need them)."),
    click.option("--mem", help="Memory per node, e.g. 64G (0: all of it)."),
    click.option("--time", help="Time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."),
    click.option("--partition"), click.option("--account"), click.option("--qos"), click.option("--constraint"),
    click.option("--job-name"),
    click.option("--profile", help="A cluster profile from the profiles file (HPC_DDP_PROFILES)."),
    click.option("--executor", type=click.Choice(NAMES),
                 help="[default: sbatch where Slurm's commands exist, else local, for what this machine "
                      "can hold]"),
    click.option("--run-dir", help="Where logs, checkpoints and the script go [default: ./runs/NAME-TIME]."),
    click.option("--sbatch-arg", "sbatch_args", multiple=True, help="Extra sbatch option, e.g. --sbatch-arg=--exclusive."),
    click.option("--srun-arg", "srun_args", multiple=True,
                 help="Extra option of the ranks' srun, e.g. --srun-arg=--cpu-bind=cores (repeatable)."),
    click.option("--container", metavar="RUNTIME:IMAGE",
                 help="Run every rank in a container: apptainer, singularity, charliecloud, podman, pyxis or shifter, "
                      "and the image (none: no container, over a profile's)."),
    click.option("--node-setup", "node_setup", multiple=True, metavar="COMMAND",
                 help="A bash line run once on every node before the ranks start, each attempt (repeatable)."),
    click.option("--env", "env", multiple=True, metavar="NAME=VALUE",
                 help="Set a variable on every rank, over the profile's and job file's env (repeatable; "
                      "$NAME in VALUE expands there)."),
    click.option("--gpu-bind", type=click.Choice(["auto", "node", "rank"]),
                 help="auto [default]: one GPU per rank as node (cuda:LOCAL_RANK and plain 'cuda' both work), "
                      "several as rank; node: every rank sees the node's GPUs and starts on its own; rank: each "
                      "rank sees only its own GPU(s), from cuda:0."),
    click.option("--signal", help="Warning signal before the time limit [default: USR2]."),
    click.option("--signal-lead", help="Seconds before the time limit to send it [default: 120]."),
    click.option("--max-requeues", help="Requeues after time limits [default: 10]."),
    click.option("--max-preemptions", help="Requeues after preemptions [default: 20]."),
    click.option("--max-restarts", help="Restarts inside the allocation per attempt, after a rank crash or a lost "
                                        "node, before the job is requeued as usual; 0: none [default: 2]."),
    click.option("--epochs"), click.option("--lr"), click.option("--batch-size"),
    click.option("--master-port",
                 help="Port rank 0 listens on for the rendezvous [default: derived from the job id]."),
    click.option("--rendezvous-timeout", help="Seconds the ranks wait for each other at start-up [default: 300]."),
    click.option("--collective-timeout",
                 help="Seconds a collective may block before the ranks give up [default: 600]."),
    click.option("--after", metavar="JOB|RUN_DIR[:ok|:any]",
                 help="Start after that job (a run dir: its last job) succeeds (:ok, the default) or ends (:any)."),
    click.option("--chain", metavar="N",
                 help="Queue N jobs up front, each starting when the one before ends and resuming the run dir "
                      "(for short time limits) [default: 1]."),
    click.option("--debug-rank", metavar="R",
                 help="Rank R starts under debugpy and waits for VS Code/PyCharm to attach (its log and `status` "
                      "show where, and the ssh tunnel); the job's timeouts are stretched meanwhile."),
    click.option("--debug-port", metavar="PORT",
                 help="Port the debug rank listens on [default: the first free one from 5678]."),
    click.option("--pdb", is_flag=True, default=None,
                 help="With --debug-rank and --executor local: that rank runs under pdb in this terminal."),
    click.option("--pass-local-rank", is_flag=True, default=None,
                 help="Append --local_rank=N to the script's arguments (torch.distributed.launch style)."),
    click.option("--stage", "datasets", multiple=True, metavar="SRC[:NAME]",
                 help="Copy a dataset (dir, .tar[.gz], .zip) to node-local disk before training (repeatable)."),
    click.option("--python", help="The Python every rank runs [default: the active venv's or conda env's, "
                                  "else the one running hpc-ddp]; it must be able to import hpc_ddp."),
    click.option("--snapshot/--no-snapshot", "snapshot", default=None,
                 help="Run a copy of your project taken now (git's files, or the script's folder), on every "
                      "attempt and requeue, whatever you edit meanwhile [default: on]; --no-snapshot: each attempt "
                      "runs the working tree as it is when it starts."),
    click.option("--snapshot-exclude", "snapshot_exclude", multiple=True, metavar="PATTERN",
                 help="Leave matching files or folders out of the snapshot (the run sees them live), e.g. data "
                      "or '*.h5' (repeatable)."),
    click.option("--snapshot-max-mb", help="Refuse to snapshot a project bigger than this [default: 256]."),
    click.option("-m", "module", help="Run a module (like python -m) instead of a script."),
    click.argument("argv", nargs=-1, type=click.UNPROCESSED, metavar="TARGET [-- ARGS...]"),
]


def spec_options(fn):
    for option in reversed(_SPEC_OPTIONS):
        fn = option(fn)
    return fn


_NOT_SPEC = ("argv", "module", "dry_run", "as_json", "no_preflight", "sweep", "max_running", "ssh", "shipped")


def build(params: dict, default_target: Target | None = None, extra: Sequence[Layer] = ()) -> JobSpec:
    flags = {k: v for k, v in params.items() if k not in _NOT_SPEC and v not in (None, ())}
    if flags.pop("pdb", None):
        flags["debugger"] = "pdb"
    spec = spec_from_command(tuple(params["argv"]), params["module"], flags, cwd=Path.cwd(), environ=os.environ,
                             python=choose(os.environ, sys.executable).path, default_target=default_target,
                             extra=extra, options=lambda tool: _options(tool, flags.get("executor")))
    _warn_unchecked(spec)
    _say_debug(spec)
    return spec


# Executors that never call the tool: its failing --help is no reason to stop them (its options are ignored
# there, as they are inside an allocation).
_UNUSED = {"sbatch": ("local", "srun"), "srun": ("local",)}


def _options(tool: str, executor: str | None) -> frozenset[str] | None:
    """What `tool` accepts here, for checking extra options. A tool on PATH whose --help fails stops the
    submission (BrokenTool), unless the executor asked for never runs it."""
    try:
        return installed_options(tool)
    except BrokenTool:
        if executor in _UNUSED[tool]:
            return None
        raise


def _say_debug(spec: JobSpec) -> None:
    """The timeouts a debug rank stretched are not the ones given: say so where the job is planned."""
    if spec.debug_rank is not None:
        verbosity.say(f"debug: rank {spec.debug_rank} starts under {spec.debugger} and waits for you; meanwhile "
                      f"rendezvous_timeout = {spec.rendezvous_timeout} s and collective_timeout = "
                      f"{spec.collective_timeout} s, so the other ranks wait instead of timing out")


def _warn_unchecked(spec: JobSpec) -> None:
    """Extra Slurm options that nothing here could check: their command is not on PATH to ask. They cannot
    matter on this machine, and on the cluster sbatch refuses an unknown option before it queues anything."""
    for tool, flag, args in ((SBATCH, "--sbatch-arg", spec.sbatch_args), (SRUN, "--srun-arg", spec.srun_args)):
        unchecked = unlisted(args, tool)
        if unchecked and _options(tool, spec.executor) is None and not SubprocessCommands().which(tool):
            warn(f"warning: {flag} {' '.join(unchecked)}: not checked, there is no {tool} on PATH here to ask "
                 "which options this cluster (and its plugins) accepts")


def executor_for(spec: JobSpec):
    """(executor, now, which) for `spec`: the requested one, else sbatch where it exists, else local where
    this machine can hold the job. `which` ("executor local (no sbatch on PATH, ...)") is for the caller to
    say once the job is planned: a refused job is one line, the refusal."""
    commands = SubprocessCommands()
    name, why = resolve_executor(spec, commands.which("sbatch") is not None)
    now = _dt.datetime.now()
    command_line = shlex.join(["hpc-ddp", *sys.argv[1:]]) if sys.argv else "hpc-ddp"
    return get_executor(name, commands=commands, generated_at=now.isoformat(timespec="seconds"),
                        command_line=command_line), now, f"executor {name} ({why})"


def warn(message: str) -> None:
    verbosity.say(message)  # -q keeps only "warning: ..." lines
