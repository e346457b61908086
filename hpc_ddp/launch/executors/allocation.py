"""The Slurm allocation a shell is in, as its SLURM_* variables describe it (`allocation_from_env`), and a
job fitted to it (`fit_to_allocation`): sizes the user left at their defaults take the allocation's (all of
its nodes, its GPUs per node, one rank per GPU), and a job bigger than the allocation is refused, naming
both numbers. Pure; the srun executor (srun.py) plans with it."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from hpc_ddp.common.errors import UserError
from hpc_ddp.slurm.nodelist import expand_hostlist, expand_tasks_per_node
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["ALLOCATION_HINT", "Allocation", "allocation_from_env", "fit_to_allocation",
           "sizes_given_on_command_line"]

ALLOCATION_HINT = ("run `salloc -N2 --gpus-per-node=2 --ntasks-per-node=2` (your sizes) first and run hpc-ddp in "
                   "the shell it opens, or submit a batch job instead (hpc-ddp submit --executor sbatch)")
# Step ids Slurm keeps for steps that are no srun of ours (batch, extern, interactive: 0xfffffff0 and up).
_SPECIAL_STEPS = 0xFFFFFFF0


# ---- the allocation (pure) ----

@dataclasses.dataclass(frozen=True)
class Allocation:
    """The Slurm allocation this process runs in, as its SLURM_* variables say. A count the variables
    do not give is None (`salloc --gres=gpu:2` sets no GPU variable): it is then not checked here, and
    srun refuses a step that does not fit."""

    job_id: str
    nodes: int
    nodelist: str
    gpus_per_node: int | None = None
    gpus_from: str | None = None          # the variable and value the GPU count came from
    cpus_per_node: int | None = None      # the fewest any node of the allocation has
    cpus_from: str | None = None
    gpus_per_node_variable: bool = False  # SLURM_GPUS_PER_NODE is set: srun reads it as --gpus-per-node
    step: str | None = None               # the id of the step this shell itself runs in (srun --pty bash)


def allocation_from_env(env: Mapping[str, str]) -> Allocation:
    """The allocation `env` is inside, or a UserError (one line, with the fix) when there is none."""
    job_id = (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip()
    if not job_id:
        raise UserError("--executor srun starts the ranks as a step of the current Slurm allocation, and this "
                        "shell is in none (SLURM_JOB_ID is not set)", hint=ALLOCATION_HINT)
    if not job_id.isdigit():
        raise UserError(f"SLURM_JOB_ID={job_id[:40]!r} is not a Slurm job id", hint=ALLOCATION_HINT)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    nodes = _count(env, "SLURM_JOB_NUM_NODES") or _count(env, "SLURM_NNODES") or _hosts(nodelist)
    if not nodes:
        raise UserError(f"allocation {job_id} does not say how many nodes it has (no SLURM_JOB_NUM_NODES, "
                        "SLURM_NNODES or SLURM_JOB_NODELIST)", hint=ALLOCATION_HINT)
    gpus, gpus_from = _gpus_per_node(env)
    cpus, cpus_from = _cpus_per_node(env)
    return Allocation(job_id, nodes, nodelist, gpus, gpus_from, cpus, cpus_from,
                      gpus_per_node_variable=bool(env.get("SLURM_GPUS_PER_NODE")), step=_own_step(env))


def _count(env: Mapping[str, str], name: str) -> int | None:
    raw = (env.get(name) or "").strip()
    return int(raw) if raw.isdigit() else None


def _hosts(nodelist: str) -> int | None:
    try:
        return len(expand_hostlist(nodelist)) if nodelist else None
    except Exception:  # noqa: BLE001 - a list we cannot read says nothing; the node count must come elsewhere
        return None


def _gpus_per_node(env: Mapping[str, str]) -> tuple[int | None, str | None]:
    """GPUs per node: salloc's --gpus-per-node (`2`, `a100:2`, `a100:2,v100:1`), else the GPUs listed for
    the job (batch jobs) or for this node's step, else unknown."""
    raw = (env.get("SLURM_GPUS_PER_NODE") or "").strip()
    if raw:
        counts = [item.rpartition(":")[2] for item in raw.split(",")]
        if all(c.isdigit() for c in counts):
            return sum(int(c) for c in counts), f"SLURM_GPUS_PER_NODE={raw}"
    for name in ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        raw = (env.get(name) or "").strip()
        if raw:
            return len([g for g in raw.split(",") if g.strip()]), f"{name}={raw}"
    gpus = _count(env, "SLURM_GPUS_ON_NODE")
    return (gpus, f"SLURM_GPUS_ON_NODE={gpus}") if gpus is not None else (None, None)


def _cpus_per_node(env: Mapping[str, str]) -> tuple[int | None, str | None]:
    raw = (env.get("SLURM_JOB_CPUS_PER_NODE") or "").strip()
    if raw:
        try:
            return min(expand_tasks_per_node(raw)), f"SLURM_JOB_CPUS_PER_NODE={raw}"
        except Exception:  # noqa: BLE001 - an unreadable value: the CPUs are left to srun to check
            return None, None
    cpus = _count(env, "SLURM_CPUS_ON_NODE")
    return (cpus, f"SLURM_CPUS_ON_NODE={cpus}") if cpus is not None else (None, None)


def _own_step(env: Mapping[str, str]) -> str | None:
    """The regular step this shell runs in (`srun --pty bash`), whose CPUs a new step would wait for."""
    raw = (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID") or "").strip()
    return raw if raw.isdigit() and int(raw) < _SPECIAL_STEPS else None


# ---- fitting the job to the allocation (pure) ----

SIZES = ("nodes", "gpus", "tasks_per_node")


def fit_to_allocation(spec: JobSpec, alloc: Allocation, given: frozenset[str] | None) -> JobSpec:
    """`spec` sized for `alloc`: nodes, GPUs and tasks per node the user did not give (`given`: the size
    options on the command line; None: unknown, the spec is taken as it is) become the allocation's.
    The spec cannot tell a default from a value: a job file's `nodes = 1` counts as the default, so
    `--nodes 1` is how to use one node of a bigger allocation. Refused, naming both numbers: more nodes,
    GPUs or CPUs per node than the allocation has."""
    fitted = dataclasses.replace(spec, **_defaults_from(spec, alloc, given))
    _check_fits(fitted, alloc)
    return fitted


def _defaults_from(spec: JobSpec, alloc: Allocation, given: frozenset[str] | None) -> dict[str, int]:
    if given is None:
        return {}
    out: dict[str, int] = {}
    if spec.nodes_max and spec.nodes <= alloc.nodes:  # a range runs on as many of the allocation's as it may
        out["nodes"] = min(alloc.nodes, spec.nodes_max)
    elif "nodes" not in given and spec.nodes == 1 and alloc.nodes > 1:
        out["nodes"] = alloc.nodes
    gpus = alloc.gpus_per_node
    if "gpus" not in given and spec.gpus == 0 and gpus:
        chosen = "tasks_per_node" in given or spec.tasks_per_node != 1  # on the command line, or in a job file
        tasks = spec.tasks_per_node if chosen else gpus
        if gpus % tasks == 0:  # tasks the user gave that cannot share the GPUs: a CPU job, GPUs left alone
            out.update(gpus=gpus, tasks_per_node=tasks)
    return out


def _check_fits(spec: JobSpec, alloc: Allocation) -> None:
    where = f"allocation {alloc.job_id}"
    if spec.nodes > alloc.nodes:
        raise UserError(f"--nodes {spec.nodes_text}: {where} has {alloc.nodes} node(s) ({alloc.nodelist or '?'})",
                        hint=f"use --nodes {alloc.nodes} or fewer, or salloc -N{spec.nodes}")
    if alloc.gpus_per_node is not None and spec.gpus > alloc.gpus_per_node:
        raise UserError(f"--gpus {spec.gpus}: {where} has {alloc.gpus_per_node} GPU(s) per node ({alloc.gpus_from})",
                        hint=f"use --gpus {alloc.gpus_per_node} or fewer, or salloc --gpus-per-node={spec.gpus}")
    if spec.gpus and (spec.tasks_per_node > spec.gpus or spec.gpus % spec.tasks_per_node):
        raise UserError(f"{spec.tasks_per_node} tasks per node do not fit {spec.gpus} GPUs per node",
                        hint=f"use --tasks-per-node {spec.gpus} (one task per GPU) or a divisor of {spec.gpus}")
    per_task = spec.cpus_per_task or 1
    need = spec.tasks_per_node * per_task
    if alloc.cpus_per_node is not None and need > alloc.cpus_per_node:
        raise UserError(f"{spec.tasks_per_node} task(s) per node x {per_task} CPU(s) each need {need} CPUs per "
                        f"node, and {where} has {alloc.cpus_per_node} ({alloc.cpus_from})",
                        hint=f"salloc with --ntasks-per-node={spec.tasks_per_node}"
                             f"{f' --cpus-per-task={per_task}' if per_task > 1 else ''} as well, or ask for fewer "
                             f"tasks (--tasks-per-node) or CPUs (--cpus-per-task)")


def sizes_given_on_command_line() -> frozenset[str] | None:
    """Which of --nodes, --gpus and --tasks-per-node the user typed, from the click command being run;
    None outside one (the spec is then taken as it is). The spec cannot say: its default of 1 node looks
    like `--nodes 1`."""
    try:
        import click
    except ImportError:  # pragma: no cover - click is a dependency; a library caller without it gets no defaults
        return None
    ctx = click.get_current_context(silent=True)
    if ctx is None or not all(name in ctx.params for name in SIZES):
        return None
    return frozenset(name for name in SIZES if ctx.params[name] is not None)
