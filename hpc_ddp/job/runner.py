"""The per-rank runner: what each task of the job starts (`python -m hpc_ddp.job.runner RUN_DIR/spec.json`).

It derives the DistEnv, exports the torchrun-compatible variables (and those managed platforms inject),
gives the rank its GPUs (gpubind: which it sees, which torch starts on), then replaces itself with the
user's program (exec), so signals from Slurm go straight to it. Everything but `main` is pure.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from hpc_ddp.common import rundir
from hpc_ddp.common.errors import EnvError, report
from hpc_ddp.common.events import JsonLines
from hpc_ddp.common.machine import physical_gpus
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.job import devicescan
from hpc_ddp.job.distenv import DistEnv, from_environ
from hpc_ddp.job.exitsite.hpc_ddp_code import DIR_VARIABLE as CODE_DIR_VARIABLE
from hpc_ddp.job.exitsite.hpc_ddp_code import PROJECT_VARIABLE as CODE_PROJECT_VARIABLE
from hpc_ddp.job.exitsite.hpc_ddp_warned import EVENTS_VARIABLE
from hpc_ddp.job.exitsite.hpc_ddp_warned import SIGNAL_VARIABLE as WARNED_VARIABLE
from hpc_ddp.job.gpubind import BINDING_VARIABLE, DEVICE_VARIABLE, NO_GPU, bind_gpus, entries
from hpc_ddp.job.ports import PORT_HINT, port_in_use, taken_port_message
from hpc_ddp.spec.code import pinned
from hpc_ddp.spec.jobspec import JobSpec, load_spec
from hpc_ddp.spec.siteenv import expand

__all__ = ["rank_environment", "site_environment", "run_id_for", "program_argv", "with_exit_guard",
           "main"]

def gpu_visible(cuda_visible: str | None, nvidia_driver: bool) -> bool:
    """A GPU is usable when the NVIDIA driver is loaded and CUDA_VISIBLE_DEVICES does not hide them all."""
    return nvidia_driver and (cuda_visible is None or cuda_visible.strip() not in NO_GPU)


def run_id_for(run_dir: str) -> str:
    """A stable id for the run dir: its name (W&B's id alphabet) and a hash of its absolute path, so
    two runs named alike in different places differ. The same on every rank and every requeue."""
    path = os.path.abspath(run_dir)
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", os.path.basename(path.rstrip("/")))[:40].strip("-") or "run"
    return f"{name}-{hashlib.sha256(path.encode()).hexdigest()[:12]}"


def rank_environment(spec: JobSpec, dist: DistEnv, env: Mapping[str, str], run_dir: str, *,
                     nvidia_driver: bool) -> dict[str, str]:
    """Variables to set for the user's program (added to its inherited environment)."""
    per_task = spec.gpus // spec.tasks_per_node if spec.gpus else 0
    binding = bind_gpus(env.get("CUDA_VISIBLE_DEVICES"), dist.local_rank, dist.local_world_size, per_task,
                        spec.gpu_bind) if spec.gpus else None
    cuda = binding.visible if binding is not None else env.get("CUDA_VISIBLE_DEVICES")
    out = {
        "MASTER_ADDR": dist.master_addr, "MASTER_PORT": str(spec.master_port or dist.master_port),
        "RANK": str(dist.rank), "LOCAL_RANK": str(dist.local_rank),
        "WORLD_SIZE": str(dist.world_size), "LOCAL_WORLD_SIZE": str(dist.local_world_size),
        "GROUP_RANK": str(dist.node_rank), "NODE_RANK": str(dist.node_rank),
        "GROUP_WORLD_SIZE": str(dist.num_nodes), "ROLE_RANK": str(dist.rank),
        "ROLE_WORLD_SIZE": str(dist.world_size),
        "HPC_DDP_RUN_DIR": run_dir, "HPC_DDP_HOSTS": ",".join(dist.hosts),
        "HPC_DDP_RESTART_COUNT": str(dist.restart_count),
        # What managed training platforms inject, so scripts written for them run unchanged.
        "BACKEND": env.get("HPC_DDP_BACKEND") or ("nccl" if gpu_visible(cuda, nvidia_driver) else "gloo"),
        "WORKSPACE": run_dir, "WORKER_PER_NODE": str(dist.local_world_size),
        "PYTHONUNBUFFERED": "1",
        # Bounds a script of the user's own can pass to init_process_group(timeout=...).
        "HPC_DDP_RENDEZVOUS_TIMEOUT": str(spec.rendezvous_timeout),
        "HPC_DDP_COLLECTIVE_TIMEOUT": str(spec.collective_timeout),
    }
    if dist.job_id:
        out["HPC_DDP_JOB_ID"] = dist.job_id
    # One run id for every attempt of the run dir, so a requeued job continues the same W&B run (and any
    # logger keyed on it); W&B offline unless the user says otherwise: compute nodes often have no internet.
    # A value the user set is theirs: it is inherited, not overwritten.
    run_id = env.get("HPC_DDP_RUN_ID") or run_id_for(run_dir)
    defaults = {"HPC_DDP_RUN_ID": run_id, "WANDB_RUN_ID": run_id, "WANDB_RESUME": "allow", "WANDB_MODE": "offline"}
    out.update({k: v for k, v in defaults.items() if k not in env})
    if cuda is not None:
        out["CUDA_VISIBLE_DEVICES"] = cuda
    if binding is not None and binding.device is not None:
        # Where torch's current device starts (exitsite sets it when CUDA starts), so a script that says
        # plain "cuda" lands on this rank's own GPU, not every rank of the node on cuda:0.
        out[DEVICE_VARIABLE] = str(binding.device)
        out[BINDING_VARIABLE] = binding.how
    # A handler of the program's own for the warning signal records that the warning reached it
    # (exitsite/hpc_ddp_warned.py): an exit 0 after it is a stop, not a completion.
    out[WARNED_VARIABLE] = spec.signal
    if spec.code is not None:
        # The project's imports come from the snapshot (exitsite/hpc_ddp_code.py); HPC_DDP_CODE_ID names it.
        out.update({CODE_PROJECT_VARIABLE: spec.code.project, CODE_DIR_VARIABLE: spec.code.dir,
                    "HPC_DDP_CODE_ID": spec.code.id})
    out[EVENTS_VARIABLE] = str(RunDir(run_dir).events)
    if "OMP_NUM_THREADS" not in env:
        # torchrun's default; one thread per rank unless the job gave each task more CPUs.
        out["OMP_NUM_THREADS"] = str(spec.cpus_per_task or env.get("SLURM_CPUS_PER_TASK") or 1)
    for name, value in (("EPOCHS", spec.epochs), ("LR", spec.lr), ("BATCH_SIZE", spec.batch_size)):
        if value is not None:
            out[name] = str(value)
    return out


def site_environment(spec: JobSpec, env: Mapping[str, str]) -> dict[str, str]:
    """The spec's env table, its $NAME references expanded against this rank's environment (so $RANK and
    $SLURM_TMPDIR mean this rank's). Set after hpc-ddp's own variables, which it may not name."""
    return {name: expand(value, env) for name, value in spec.env}


EXIT_GUARD_DIR = str(Path(__file__).resolve().parent / "exitsite")


def with_exit_guard(pythonpath: str | None, guard_dir: str = EXIT_GUARD_DIR) -> str:
    """PYTHONPATH with exitsite/ first: its sitecustomize destroys a process group the program left open,
    before the interpreter's shutdown can abort the rank (see that file). The rest stays as it was."""
    rest = [p for p in pythonpath.split(os.pathsep) if p != guard_dir] if pythonpath else []
    return os.pathsep.join([guard_dir, *rest])


def program_argv(spec: JobSpec, dist: DistEnv, python: str, spec_path: str = rundir.SPEC) -> list[str]:
    target = spec.target
    if target.kind == "script":
        # The snapshot's copy of the script where submit took one: the code as submitted, on every attempt.
        script = spec.code.script if spec.code is not None and spec.code.script else target.value
        argv = [python, script, *target.args]
    elif target.kind == "module":
        argv = [python, "-m", target.value, *target.args]
    else:
        argv = [python, "-m", "hpc_ddp.trainer.train", spec_path]
    if spec.pass_local_rank:
        argv.append(f"--local_rank={dist.local_rank}")
    return argv




# torchrun-style variables that a Slurm step may have inherited from the submitting shell (sbatch
# exports it): from a DDP job that submitted this one, or an `export MASTER_ADDR=localhost` left over
# from debugging. Inside a Slurm step they are stale; Slurm's own variables say who this rank is.
_STALE_IN_STEP = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                  "NODE_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "HPC_DDP_HOSTS")


def clean_environ(env: Mapping[str, str]) -> dict[str, str]:
    out = dict(env)
    if "SLURM_STEP_ID" in out and "TORCHELASTIC_RUN_ID" not in out and "HPC_DDP_LOCAL" not in out:
        for name in _STALE_IN_STEP:
            out.pop(name, None)
    return out


def prepare(spec_path: str) -> tuple[list[str], dict[str, str]]:
    """Everything the exec needs: the program's argv and its full environment."""
    spec = load_spec(spec_path)
    _check_code(spec)
    base = clean_environ(os.environ)
    dist = from_environ(base, pid=os.getpid())
    run_dir = str(Path(spec_path).resolve().parent)
    env = dict(base)
    env.update(rank_environment(spec, dist, base, run_dir, nvidia_driver=physical_gpus() > 0))
    env.update(site_environment(spec, env))
    env["PYTHONPATH"] = with_exit_guard(env.get("PYTHONPATH"))
    _check_device_pick(spec, dist, env)
    _check_master_port(dist, int(env["MASTER_PORT"]))
    if dist.rank == 0:
        _record_environment(run_dir, dist)
    if spec.datasets:
        from hpc_ddp.job.stagejob import dataset_env, scratch_dir, stage_for_job

        staged = stage_for_job(spec, dist, Path(run_dir), os.environ,
                               log=lambda m: print(m, file=sys.stderr, flush=True))
        env.update(dataset_env(staged, scratch_dir(spec, os.environ), spec))
    argv = program_argv(spec, dist, sys.executable, str(Path(spec_path).resolve()))
    return _under_debugger(spec, dist, argv, env, run_dir), env


def _under_debugger(spec: JobSpec, dist: DistEnv, argv: list[str], env: dict[str, str], run_dir: str) -> list[str]:
    """--debug-rank: that rank's program starts under its debugger (debugpy: connected to the owner-only
    relay that `wrap` starts first), and says how to attach in its log and events."""
    from hpc_ddp.job import debugger

    argv, record = debugger.wrap(spec, dist.rank, argv, env, say=lambda m: print(m, flush=True),
                                 job_id=dist.job_id or "")
    if record is not None and spec.code is not None and spec.debugger == "debugpy":
        # The rank runs the snapshot's copy; your editor sets breakpoints in the working tree's files.
        # debugpy (pydevd) translates between the two, both ways, so breakpoints hit and frames name your files.
        # A copy shipped from a laptop (submit --ssh): the laptop's paths first, so frames name its files there.
        pairs = [[spec.code.origin, spec.code.dir]] if spec.code.origin else []
        env.setdefault("PATHS_FROM_ECLIPSE_TO_PYTHON", json.dumps([*pairs, [spec.code.project, spec.code.dir]]))
    if record is not None:
        JsonLines(Path(run_dir) / rundir.EVENTS).write({**record, "job_id": dist.job_id})
    return argv


def _check_device_pick(spec: JobSpec, dist: DistEnv, env: Mapping[str, str]) -> None:
    """A script whose way of picking its GPU cannot work under the binding this rank got (a site may bind
    GPUs per task whatever was asked) stops here, in one line, not in CUDA or NCCL from inside torch."""
    how = env.get(BINDING_VARIABLE)
    if how not in ("node", "rank", "slurm"):
        return
    script = spec.code.script if spec.code is not None and spec.code.script else spec.target.value
    found = devicescan.source_of(spec.target.kind, script, pinned(spec.code, spec.workdir))
    if found is None:
        return
    path, text = found
    visible = env.get("CUDA_VISIBLE_DEVICES")
    exposure = devicescan.runtime_exposure(how, len(entries(visible)), spec.gpus // spec.tasks_per_node,
                                           dist.local_world_size, dist.num_nodes, visible)
    problems = devicescan.judge(devicescan.scan(text), exposure, os.path.basename(path))
    errors = [p for p in problems if p.level == "error"]
    if errors:
        raise EnvError(errors[0].message, hint=errors[0].hint)


def _record_environment(run_dir: str, dist: DistEnv) -> None:
    """This attempt's Python, packages, torch, CUDA and NCCL (job.provenance); a note if that fails."""
    from hpc_ddp.job import provenance

    try:
        provenance.record(Path(run_dir), RunDir(run_dir).events, job_id=dist.job_id, attempt=dist.restart_count,
                          node=socket.gethostname())
    except Exception as exc:  # noqa: BLE001 - a record we could not write is not the run's failure
        print(f"hpc-ddp: note: the environment of this attempt was not recorded: {exc}", file=sys.stderr, flush=True)


def _check_code(spec: JobSpec) -> None:
    """The snapshot the run was submitted with must still be there: running the working tree instead would
    break the promise silently."""
    if spec.code is not None and not os.path.isdir(spec.code.dir):
        raise EnvError(f"the code snapshot {spec.code.id} of this run is gone ({spec.code.dir} does not exist)",
                       hint="submit the run again (a new snapshot of the working tree), or with --no-snapshot")


def _check_master_port(dist: DistEnv, port: int) -> None:
    """Rank 0 will listen on MASTER_PORT: if something holds it, say so now, not after the others time out."""
    if dist.rank == 0 and dist.world_size > 1 and port_in_use(port):
        raise EnvError(taken_port_message(port, socket.gethostname()), hint=PORT_HINT)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m hpc_ddp.job.runner RUN_DIR/spec.json")
    try:
        # First: a warning that comes while this runner prepares (seconds on a loaded node, or a restart in
        # place late in the allocation) must not kill the rank before its program could handle it.
        _ignore_warning_signal(load_spec(args[0]))
        program, env = prepare(args[0])
    except Exception as exc:  # noqa: BLE001 - the rank's log gets one line (a traceback for a bug)
        sys.exit(report(exc, "hpc-ddp runner", traceback_for_bugs=True))
    sys.stdout.flush()
    os.execve(program[0], program, env)


def _ignore_warning_signal(spec: JobSpec) -> None:
    """A script written for torchrun has no handler for SIGUSR1/SIGUSR2, whose default action kills it
    two minutes before its time limit. An ignored signal stays ignored across exec, and a program that
    wants the warning (our trainer, or a script with its own handler) installs a handler over it. Our
    trainer too: Slurm may send the warning early, while the ranks still import torch, and a warning that
    comes before the handler is installed must not kill them (the deadline still stops them in time)."""
    if spec.signal in ("USR1", "USR2"):
        signal.signal(getattr(signal, f"SIG{spec.signal}"), signal.SIG_IGN)


if __name__ == "__main__":
    main()
