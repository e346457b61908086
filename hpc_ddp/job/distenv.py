"""Environment mapping -> frozen `DistEnv`: who am I in the job, and where is rank 0.

Pure: `from_environ(env)` reads only the mapping it is given. Sources are tried in order:
torchrun / env:// variables, a Slurm step (inside `srun`), submitit's local executor, a single process.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

from hpc_ddp.common.errors import EnvError
from hpc_ddp.slurm.nodelist import expand_hostlist, expand_tasks_per_node

__all__ = ["DistEnv", "from_environ", "port_for_job", "PORT_BASE", "PORT_SPAN"]

# Master ports live in [20000, 32000): below Linux's ephemeral range (32768-60999), so the OS never hands
# our port to an outgoing connection, and above the usual service ports.
PORT_BASE = 20000
PORT_SPAN = 12000


@dataclasses.dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int
    hosts: tuple[str, ...]
    job_id: str | None
    restart_count: int
    source: str

    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["hosts"] = list(self.hosts)
        return data

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def port_for_job(job_id: str | None) -> int:
    """The same port on every rank and after a requeue (the job id survives it).

    Consecutive numeric ids get consecutive ports, so jobs sharing a node only collide when their ids
    differ by a multiple of PORT_SPAN.
    """
    if job_id and job_id.isdigit():
        return PORT_BASE + int(job_id) % PORT_SPAN
    digest = hashlib.sha256((job_id or "").encode()).digest()
    return PORT_BASE + int.from_bytes(digest[:4], "big") % PORT_SPAN


def from_environ(env: Mapping[str, str], *, pid: int = 0) -> DistEnv:
    """Derive the distributed environment from `env` (usually `os.environ`)."""
    for detect in (_from_torchrun, _from_slurm_step, _from_submitit_local):
        found = detect(env)
        if found is not None:
            return _checked(found)
    return _single_process(env, pid)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise EnvError(f"{name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer") from None


def _master_port(env: Mapping[str, str], job_id: str | None) -> int:
    if env.get("MASTER_PORT"):
        port = _int(env, "MASTER_PORT")
        if not 1 <= port <= 65535:
            raise EnvError(f"MASTER_PORT={port} is not a valid port")
        return port
    return port_for_job(job_id)


def _restart_count(env: Mapping[str, str]) -> int:
    return _int(env, "SLURM_RESTART_COUNT", _int(env, "HPC_DDP_RESTART_COUNT", 0))


def _slurm_hosts(env: Mapping[str, str]) -> tuple[str, ...]:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            return expand_hostlist(env[name])
    return ()


def _from_torchrun(env: Mapping[str, str]) -> DistEnv | None:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    world = _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    job_id = env.get("HPC_DDP_JOB_ID") or env.get("SLURM_JOB_ID") or env.get("TORCHELASTIC_RUN_ID")
    master = env.get("MASTER_ADDR") or "127.0.0.1"
    num_nodes = _int(env, "GROUP_WORLD_SIZE", max(1, world // max(local_world, 1)))
    hosts = tuple(h for h in env.get("HPC_DDP_HOSTS", "").split(",") if h) or _slurm_hosts(env)
    return DistEnv(
        rank=_int(env, "RANK"),
        local_rank=_int(env, "LOCAL_RANK", 0),
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", _int(env, "NODE_RANK", 0)),
        num_nodes=num_nodes,
        master_addr=master,
        master_port=_master_port(env, job_id),
        hosts=hosts or ((master,) if num_nodes == 1 else ()),
        job_id=job_id,
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", _restart_count(env)),
        source="torchrun",
    )


def _from_slurm_step(env: Mapping[str, str]) -> DistEnv | None:
    if "SLURM_JOB_ID" not in env:
        return None
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        if _int(env, "SLURM_NTASKS", 1) > 1 or _int(env, "SLURM_JOB_NUM_NODES", 1) > 1:
            raise EnvError(
                "this is the batch shell of a multi-task Slurm job, not one of its tasks",
                hint="launch it with srun, which starts one task per rank (`srun python train.py`), "
                     "or let `hpc-ddp run train.py` do that",
            )
        return None
    hosts = _slurm_hosts(env)
    tasks = expand_tasks_per_node(
        env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    )
    node_rank = _int(env, "SLURM_NODEID", 0)
    if node_rank >= len(tasks):
        raise EnvError(f"SLURM_NODEID={node_rank} but tasks per node lists only {len(tasks)} node(s)")
    job_id = env["SLURM_JOB_ID"]
    world = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", sum(tasks)))
    return DistEnv(
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        world_size=world,
        local_world_size=tasks[node_rank],
        node_rank=node_rank,
        num_nodes=_int(env, "SLURM_STEP_NUM_NODES", len(hosts) or len(tasks)),
        master_addr=env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1"),
        master_port=_master_port(env, job_id),
        hosts=hosts,
        job_id=job_id,
        restart_count=_restart_count(env),
        source="slurm",
    )


# submitit's LocalExecutor runs every task on this one machine; its names, as submitit's own table has them.
_SUBMITIT_LOCAL = {
    "job_id": "SUBMITIT_LOCAL_JOB_ID",
    "num_tasks": "SUBMITIT_LOCAL_NTASKS",
    "num_nodes": "SUBMITIT_LOCAL_JOB_NUM_NODES",
    "node": "SUBMITIT_LOCAL_NODEID",
    "global_rank": "SUBMITIT_LOCAL_GLOBALID",
    "local_rank": "SUBMITIT_LOCAL_LOCALID",
}


def _from_submitit_local(env: Mapping[str, str]) -> DistEnv | None:
    names = _SUBMITIT_LOCAL
    if names["global_rank"] not in env:
        return None
    job_id = env.get(names["job_id"])
    num_nodes = _int(env, names["num_nodes"], 1)
    world = _int(env, names["num_tasks"], 1)
    return DistEnv(
        rank=_int(env, names["global_rank"]),
        local_rank=_int(env, names["local_rank"], 0),
        world_size=world,
        local_world_size=world // num_nodes,
        node_rank=_int(env, names["node"], 0),
        num_nodes=num_nodes,
        master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
        master_port=_master_port(env, job_id),
        hosts=("127.0.0.1",) * num_nodes,
        job_id=job_id,
        restart_count=_restart_count(env),
        source="submitit",
    )


def _single_process(env: Mapping[str, str], pid: int) -> DistEnv:
    job_id = env.get("SLURM_JOB_ID") or env.get("HPC_DDP_JOB_ID")
    master = env.get("MASTER_ADDR") or "127.0.0.1"
    return DistEnv(
        rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, num_nodes=1,
        master_addr=master,
        master_port=_master_port(env, job_id or f"pid-{pid}"),
        hosts=_slurm_hosts(env)[:1] or (master,),
        job_id=job_id,
        restart_count=_restart_count(env),
        source="single",
    )


def _checked(d: DistEnv) -> DistEnv:
    problems = []
    if not 0 <= d.rank < d.world_size:
        problems.append(f"rank {d.rank} is outside world size {d.world_size}")
    if not 0 <= d.local_rank < d.local_world_size:
        problems.append(f"local rank {d.local_rank} is outside local world size {d.local_world_size}")
    if not 0 <= d.node_rank < d.num_nodes:
        problems.append(f"node rank {d.node_rank} is outside {d.num_nodes} node(s)")
    if d.hosts and len(d.hosts) != d.num_nodes and d.source == "slurm":
        problems.append(f"{len(d.hosts)} host(s) in the node list but {d.num_nodes} node(s) in the step")
    if problems:
        raise EnvError(f"inconsistent {d.source} environment: " + "; ".join(problems))
    return d
