"""The environment Slurm gives each task of a step of `nodes` x `per_node` tasks, as `srun` sets it
(the variables `hpc_ddp.job.distenv.from_environ` reads), for simulated hosts sim0001, sim0002, ..."""

from __future__ import annotations

__all__ = ["hosts", "nodelist", "rank_env"]


def hosts(nodes: int) -> list[str]:
    return [f"sim{n + 1:04d}" for n in range(nodes)]


def nodelist(nodes: int) -> str:
    """What Slurm puts in SLURM_JOB_NODELIST: compressed, `sim[0001-0256]`."""
    return f"sim[0001-{nodes:04d}]" if nodes > 1 else "sim0001"


def rank_env(rank: int, nodes: int, per_node: int, *, job_id: str = "4242", restart: int = 0,
             tmpdir: str | None = None) -> dict[str, str]:
    node = rank // per_node
    env = {
        "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(node), "SLURM_STEP_NODELIST": nodelist(nodes), "SLURM_JOB_NODELIST": nodelist(nodes),
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{nodes})", "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_STEP_NUM_TASKS": str(nodes * per_node), "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_RESTART_COUNT": str(restart),
        "SLURMD_NODENAME": f"sim{node + 1:04d}",
    }
    if tmpdir:
        env["SLURM_TMPDIR"] = tmpdir
    return env
