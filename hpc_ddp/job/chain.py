"""A run's chain: the Slurm jobs that carry one run dir forward, each waiting for the one before
(`sbatch --dependency=afterany:PREVIOUS`). A job joins a chain in two ways: `hpc-ddp submit --chain N`
queues N of them up front (clusters with short time limits), and the batch script queues the next
attempt as a new job where `scontrol requeue` is impossible (the requeue fallback). Either way the link
is recorded in the run dir's submissions.jsonl, next to the submission itself:

    {"executor": "sbatch", "job_id": "102", ..., "chain": "101", "previous": "101", "via": "chain"}

`chain` is the job id of the chain's first job. The requeue policy (`attempts`) counts attempts per
chain, so its caps hold across job ids, and a new `hpc-ddp submit` of the run dir (a new chain, whose
record names no chain) starts them afresh. This module reads and writes those records, and queues the
requeue fallback's job (`queue_next`): on the compute node, with nothing of the launcher.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from hpc_ddp.common.durable import append
from hpc_ddp.common.events import read_jsonl
from hpc_ddp.common.rundir import RunDir

__all__ = ["chain_of", "link", "members", "queue_next", "record", "sbatch_env", "successor"]

# Slurm variables that the job's own sbatch must not pass on to the next job: they describe this
# allocation (SLURM_RESTART_COUNT would number the next job's attempts wrongly, SLURM_MEM_PER_NODE
# and friends would change its srun steps). SLURM_CONF says which cluster: it stays.
_KEEP = ("SLURM_CONF",)


def _records(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(RunDir(run_dir).submissions) if isinstance(r, dict)]


def chain_of(run_dir: str | os.PathLike, job_id: str) -> str:
    """The chain `job_id` belongs to: the first job's id, or `job_id` itself for a job that starts one
    (a plain submission, or one not recorded yet)."""
    mine = [r for r in _records(run_dir) if str(r.get("job_id")) == job_id and r.get("chain")]
    return str(mine[-1]["chain"]) if mine else job_id


def members(run_dir: str | os.PathLike, chain: str) -> set[str]:
    """The job ids of chain `chain`: its first job and every job linked to it."""
    return {chain} | {str(r["job_id"]) for r in _records(run_dir) if str(r.get("chain")) == chain and r.get("job_id")}


def successor(run_dir: str | os.PathLike, job_id: str) -> str | None:
    """The job queued to carry on after `job_id` (the next of its chain), if one was."""
    after = [r for r in _records(run_dir) if str(r.get("previous")) == job_id and r.get("job_id")]
    return str(after[-1]["job_id"]) if after else None


def link(submission: Mapping[str, Any], chain: str, previous: str, via: str) -> dict[str, Any]:
    """A submission's record, linked to its chain. `via`: "chain" (--chain) or "requeue_fallback"."""
    return {**submission, "chain": chain, "previous": previous, "via": via}


def record(run_dir: str | os.PathLike, entry: Mapping[str, Any]) -> None:
    """Append one submission record (the format `launch.executors.base.record_submission` writes)."""
    append(RunDir(run_dir).submissions, json.dumps(dict(entry)) + "\n")


def sbatch_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment for an sbatch run inside a job: this allocation's SLURM_* and SRUN_* variables
    removed (they would leak into the next job), the rest (the user's, SBATCH_* included, as at the
    first submission) kept."""
    return {k: v for k, v in env.items() if k in _KEEP or not k.startswith(("SLURM_", "SRUN_"))}


def queue_next(run_dir: str | os.PathLike, job_id: str, chain: str, env: Mapping[str, str], commands=None) -> str:
    """Queue the next attempt of the run as a new job that starts when job `job_id` ends (afterany): the
    run dir's own batch script, so the same spec and the same code snapshot; linked to its chain, recorded
    as any submission and in the user's registry (a registry that cannot be written is a warning). Its id."""
    import sys

    from hpc_ddp.common.errors import HpcDdpError
    from hpc_ddp.common.procs import SubprocessCommands
    from hpc_ddp.common.registryfile import register
    from hpc_ddp.slurm.queue import sbatch
    from hpc_ddp.spec.jobspec import load_spec

    next_job = sbatch(commands or SubprocessCommands(), run_dir, dependency=f"afterany:{job_id}", env=sbatch_env(env))
    submission = {"executor": "sbatch", "job_id": next_job, "run_dir": str(run_dir),
                  "script": str(RunDir(run_dir).script), "state": "SUBMITTED", "returncode": None}
    record(run_dir, link(submission, chain, job_id, "requeue_fallback"))
    try:
        spec = load_spec(RunDir(run_dir).spec)
        register({"job_id": next_job, "executor": "sbatch", "run_dir": str(run_dir), "name": spec.job_name,
                  "nodes": spec.nodes, "gpus": spec.gpus})
    except (HpcDdpError, OSError) as exc:
        print(f"hpc-ddp: warning: job {next_job} is not in the registry: {getattr(exc, 'message', exc)}",
              file=sys.stderr)
    return next_job
