"""Executors: how a planned job is started. Each is a small class behind one protocol (`base.Executor`):
`plan(spec, run_dir)` is pure and is what `--dry-run` shows; `submit(plan)` is the side effect.
Executors load lazily, so planning an sbatch job never imports submitit or torch.

Also owns which executor a submission gets (`choose_executor`, `resolve_executor`), which executor
manages a submitted run (`executor_for_run`), and the guard on the implicit fallback:
without Slurm's commands on PATH and no --executor given, a job runs on this machine, so it runs only if
this machine can hold it (`fallback_problem`, judged against a `Machine`); anything bigger is refused
(`refuse_fallback`), since a user who forgot `module load slurm` must not start 32 processes on a
shared login node. `--executor local` keeps simulating any size on request.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.machine import NVIDIA_GPUS_DIR, physical_gpus, usable_cpus
from hpc_ddp.launch.executors.base import Executor, Plan, Run, Submission

if TYPE_CHECKING:
    from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["Executor", "Plan", "Run", "Submission", "get_executor", "choose_executor", "resolve_executor",
           "executor_for_run", "NAMES", "Machine", "NoSlurm",
           "fallback_problem", "refuse_fallback", "probe_machine", "slurm_site_signs", "visible_gpus",
           "SLURM_CONF_PLACES", "LOAD_SLURM"]

NAMES = ("sbatch", "submitit", "local", "srun")  # srun: a step of the allocation this shell is in
NO_SBATCH = "no sbatch on PATH, running on this machine"
# Where Slurm keeps its configuration by default (source builds, Debian/Ubuntu's slurm-llnl, RPMs).
SLURM_CONF_PLACES = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf", "/usr/local/etc/slurm.conf")
LOAD_SLURM = "load Slurm (`module load slurm`, or put sbatch on PATH) to submit to the cluster"


class NoSlurm(UserError):
    """No --executor, no sbatch on PATH, and the job is bigger than this machine: refused, nothing started."""


@dataclasses.dataclass(frozen=True)
class Machine:
    """This machine, as the fallback guard sees it: GPUs visible to us, CPU cores we may use, and the
    signs that it is part of a Slurm site (a slurm.conf, SLURM_* variables), each a short phrase."""

    gpus: int
    cpus: int
    slurm_signs: tuple[str, ...] = ()


def choose_executor(requested: str | None, sbatch_found: bool) -> tuple[str, str]:
    """(name, why): the requested executor, or sbatch where Slurm's commands exist, else local."""
    if requested:
        return requested, "as requested"
    if sbatch_found:
        return "sbatch", "Slurm's sbatch was found"
    return "local", NO_SBATCH


def resolve_executor(spec: JobSpec, sbatch_found: bool) -> tuple[str, str]:
    """`choose_executor` for `spec`, refusing the implicit fallback where this machine cannot hold the
    job: a user who forgot `module load slurm` must not start 8 training processes on a login node."""
    name, why = choose_executor(spec.executor, sbatch_found)
    if why == NO_SBATCH:
        refusal = refuse_fallback(spec, probe_machine())
        if refusal is not None:
            raise refusal
    return name, why


# ---- the guard (pure) ----

def fallback_problem(spec: JobSpec, machine: Machine) -> str | None:
    """Why this machine cannot hold `spec` (one phrase), or None when it can. GPUs count across every
    simulated node; every request, GPU or not, must also fit the cores (one process per rank)."""
    nodes = spec.most_nodes  # a range runs on its most here: nothing else asks for the nodes
    processes = nodes * spec.tasks_per_node
    if spec.gpus and nodes * spec.gpus > machine.gpus:
        return (f"--nodes {spec.nodes_text} x --gpus {spec.gpus} asks for {nodes * spec.gpus} GPU(s) "
                f"({processes} process(es)), and this machine has {_gpus_here(machine.gpus)}")
    if processes > machine.cpus:
        return (f"--nodes {spec.nodes_text} x {spec.tasks_per_node} task(s) per node = {processes} processes, and "
                f"this machine has {machine.cpus} CPU core(s)")
    return None


def refuse_fallback(spec: JobSpec, machine: Machine) -> NoSlurm | None:
    """The error an implicit fallback to `local` must raise for `spec` here, or None when it may run."""
    problem = fallback_problem(spec, machine)
    if problem is None:
        return None
    return NoSlurm(f"no sbatch on PATH, so this job would run here, on this machine: {problem}; "
                   f"{site_note(machine)}nothing was started",
                   hint=f"{LOAD_SLURM}, or pass --executor local to simulate "
                        f"{spec.most_nodes} node(s) on this machine anyway")


def site_note(machine: Machine) -> str:
    """'this looks like a Slurm site (...); ' when it does, else ''."""
    if not machine.slurm_signs:
        return ""
    return f"this looks like a Slurm site ({', '.join(machine.slurm_signs)}) whose commands are not loaded; "


def _gpus_here(n: int) -> str:
    return "no GPU visible" if n == 0 else f"{n} GPU(s) visible"


def slurm_site_signs(environ: Mapping[str, str], exists: Callable[[str], bool]) -> tuple[str, ...]:
    """Signs that this machine belongs to a Slurm cluster. Names only, never values: they go into a
    one-line error."""
    signs = [f"{path} exists" for path in SLURM_CONF_PLACES if exists(path)]
    if environ.get("SLURM_CONF"):
        signs.append("SLURM_CONF is set")
    others = sorted(k for k in environ if k.startswith("SLURM_") and k != "SLURM_CONF")
    if others:
        signs.append(f"{others[0]} is set" if len(others) == 1 else f"{len(others)} SLURM_* variables are set")
    return tuple(signs)


def visible_gpus(physical: int, cuda_visible: str | None) -> int:
    """How many of `physical` GPUs a process may use under CUDA_VISIBLE_DEVICES (unset: all of them).
    As CUDA reads it: the list ends at the first entry that names no device (an empty one, -1, an index
    out of range); UUIDs (GPU-..., MIG-...) count as devices."""
    if cuda_visible is None:
        return physical
    count = 0
    for entry in (e.strip() for e in cuda_visible.split(",")):
        named = entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < physical)
        if not named:
            break
        count += 1
    return min(count, physical)


# ---- the edge: look at this machine (no torch: the CLI must stay light) ----

def probe_machine(environ: Mapping[str, str] | None = None, exists: Callable[[str], bool] = os.path.exists,
                  gpu_dir: str = NVIDIA_GPUS_DIR) -> Machine:
    environ = os.environ if environ is None else environ
    gpus = visible_gpus(physical_gpus(gpu_dir), environ.get("CUDA_VISIBLE_DEVICES"))
    return Machine(gpus, usable_cpus(), slurm_site_signs(environ, exists))


def executor_for_run(name: str | None, commands=None) -> Executor:
    """The executor that manages a run submitted with executor `name` (runs from before the registry
    recorded it were sbatch's). A name hpc-ddp does not know (records edited, or written by another tool)
    is one line, exit 2."""
    if name and name not in NAMES:
        from hpc_ddp.common.errors import UserError
        from hpc_ddp.common.terminal import printable

        raise UserError(f"the run's records name the executor {printable(str(name))!r}, which hpc-ddp does not know "
                        f"(it knows {', '.join(NAMES)})", hint="its submissions.jsonl was edited or written by another "
                                                                "tool; fix the executor there")
    return get_executor(name or "sbatch", commands=commands)


def get_executor(name: str, **kwargs) -> Executor:
    if name == "sbatch":
        from hpc_ddp.launch.executors.sbatch import SbatchExecutor
        return SbatchExecutor(**kwargs)
    if name == "submitit":
        from hpc_ddp.launch.executors.submitit_exec import SubmititExecutor
        return SubmititExecutor(**kwargs)
    if name == "local":
        from hpc_ddp.launch.executors.local import LocalExecutor
        return LocalExecutor(**kwargs)
    if name == "srun":
        from hpc_ddp.launch.executors.srun import SrunExecutor
        return SrunExecutor(**kwargs)
    raise ValueError(f"unknown executor {name!r}")
