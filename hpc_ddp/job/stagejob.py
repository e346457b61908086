"""Staging inside a job: what the per-rank runner does before it execs the program.

On every node, local rank 0 stages each dataset to node-local scratch (see `staging`) while the node's
other ranks wait for its completion marker; then every node reports ready in the shared run dir and
all ranks wait for all nodes, with a timeout that names the node that did not finish. The result is a
mapping name -> staged path, exported as DATASETS_PATH, DATASETS and HPC_DDP_DATA_<NAME>.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from hpc_ddp.job.distenv import DistEnv
from hpc_ddp.common.errors import HpcDdpError
from hpc_ddp.spec.jobspec import JobSpec
from hpc_ddp.data.staging import ScratchUnusable, StagingError, is_archive, stage, wait_for_stage

__all__ = ["stage_for_job", "scratch_dir", "dataset_env"]


def scratch_dir(spec: JobSpec, env: Mapping[str, str]) -> Path:
    """The node-local directory datasets go to: the profile's `scratch` (env vars expanded), else
    $SLURM_TMPDIR, else $TMPDIR, else the system temp dir."""
    if spec.scratch:
        base = os.path.expandvars(spec.scratch)
    else:
        base = env.get("SLURM_TMPDIR") or env.get("TMPDIR") or tempfile.gettempdir()
    return Path(base) / "hpc-ddp-datasets"


def stage_for_job(spec: JobSpec, dist: DistEnv, run_dir: Path, env: Mapping[str, str],
                  log: Callable[[str], None]) -> dict[str, str]:
    scratch = scratch_dir(spec, env)
    staged = {name: _one(spec, dist, Path(src), name, scratch, log) for name, src in spec.datasets}
    _all_nodes_ready(spec, dist, run_dir, env)
    return staged


def _one(spec: JobSpec, dist: DistEnv, src: Path, name: str, scratch: Path, log: Callable[[str], None]) -> str:
    try:
        if dist.local_rank == 0:
            return str(stage(src, scratch, name=name, checksums=spec.stage_checksums, log=log,
                             lock_timeout=spec.stage_timeout).path)
        return str(wait_for_stage(src, scratch, name=name, timeout=spec.stage_timeout,
                                  checksums=spec.stage_checksums))
    except (StagingError, ScratchUnusable, OSError) as exc:
        # ScratchUnusable: the node's scratch cannot take it (not a directory, or something hpc-ddp did not
        # make sits at the target); reading the shared copy is then as good as a failed copy. Refusals about
        # the dataset itself (a hostile or truncated archive, a bad name) are other UserErrors: never caught.
        if spec.stage_fallback == "fail" or is_archive(src):
            if isinstance(exc, StagingError):
                raise
            why = exc.message if isinstance(exc, HpcDdpError) else str(exc)
            raise StagingError(f"cannot stage {name} into {scratch}: {why}",
                               hint="set the profile's scratch to a writable node-local directory") from None
        why = exc.message if isinstance(exc, HpcDdpError) else str(exc)
        log(f"hpc-ddp stage: {name}: node-local staging failed ({why}); reading the shared copy in place")
        return str(src)


def _all_nodes_ready(spec: JobSpec, dist: DistEnv, run_dir: Path, env: Mapping[str, str]) -> None:
    attempt = env.get("SLURM_RESTART_COUNT") or env.get("HPC_DDP_RESTART_COUNT") or "0"
    marks = run_dir / "stage" / f"{dist.job_id or 'job'}-{attempt}"
    marks.mkdir(parents=True, exist_ok=True)
    if dist.local_rank == 0:
        (marks / f"node-{dist.node_rank}.json").write_text(json.dumps({"host": _host(dist, dist.node_rank)}))
    deadline = time.monotonic() + spec.stage_timeout
    while True:
        missing = [n for n in range(dist.num_nodes) if not (marks / f"node-{n}.json").exists()]
        if not missing:
            return
        if time.monotonic() > deadline:
            names = ", ".join(f"node {n} ({_host(dist, n)})" for n in missing)
            raise HpcDdpError(f"staging did not finish on {names} within {spec.stage_timeout} s",
                              hint="see local rank 0's log on that node (logs/job-*/attempt-*/rank-*.log)")
        time.sleep(0.2)


def _host(dist: DistEnv, node: int) -> str:
    return dist.hosts[node] if node < len(dist.hosts) else f"node{node}"


def dataset_env(staged: Mapping[str, str], scratch: Path, spec: JobSpec) -> dict[str, str]:
    if not staged:
        return {}
    out = {"DATASETS_PATH": str(scratch), "DATASETS": ",".join(staged),
           "HPC_DDP_STAGED": json.dumps({src: staged[name] for name, src in spec.datasets})}
    out.update({f"HPC_DDP_DATA_{name.upper()}": path for name, path in staged.items()})
    return out
