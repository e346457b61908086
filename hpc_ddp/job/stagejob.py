"""Staging inside a job: what the per-rank runner does before it execs the program.

On every node, local rank 0 (the node's leader) stages each dataset to node-local scratch (see
`staging`), reports its node ready in the shared run dir and waits for every node, with a timeout that
names the node that did not finish. Then it tells the node's other ranks how it went, through a mark on
the node's own disk: the staged paths, or its error, which they raise as their own. The result is a
mapping name -> staged path, exported as DATASETS_PATH, DATASETS and HPC_DDP_DATA_<NAME>.

What this costs the shared filesystem (bench/README.md, "Scale", measures it at 2,048 ranks): only
leaders touch the run dir. Each makes the marks dir and its node's mark, then one metadata operation per
poll: node 0's leader lists the marks dir and, once every node is there, creates `all-ready`; the other
leaders stat that one file. Polls back off from 0.2 s to a cap chosen so the whole job makes at most
about FS_POLLS_PER_S of them per second, however many nodes it has. The other ranks read nothing on the
shared filesystem (the source dataset included: the leader verified the copy) and poll only their
node's disk.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from hpc_ddp.common.durable import read_regular, replace_durable, write_file
from hpc_ddp.common.errors import HpcDdpError
from hpc_ddp.common.rundir import RANK_LOGS_GLOB
from hpc_ddp.data.staging import ScratchUnusable, StagingError, is_archive, stage
from hpc_ddp.job.distenv import DistEnv
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["FS_POLLS_PER_S", "dataset_env", "poll_delays", "scratch_dir", "stage_for_job"]

FIRST_POLL_S = 0.2      # a leader's first polls of the run dir: nodes that finish together go on at once
MAX_POLL_S = 5.0        # never slower than this, at any size
FS_POLLS_PER_S = 1000   # the job's leaders together, once backed off: ~1% of what one Lustre MDS serves
LOCAL_POLL_S = 0.2      # the other ranks' polls of their node's disk: a local stat, nothing shared
LEADER_SILENT_GRACE_S = 30  # beyond the leader's own limits, before its node's ranks give up on it


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
    marks = _node_marks(scratch, dist, env)
    if dist.local_rank != 0:
        return _follow(spec, marks)
    try:
        staged = {name: _one(spec, Path(src), name, scratch, log) for name, src in spec.datasets}
        _all_nodes_ready(spec, dist, run_dir, env)
    except Exception as exc:
        if dist.local_world_size > 1:
            _tell_node(marks, _error_record(exc), log)
        raise
    if dist.local_world_size > 1:
        _tell_node(marks, {"staged": staged}, log)
    return staged


def _one(spec: JobSpec, src: Path, name: str, scratch: Path, log: Callable[[str], None]) -> str:
    try:
        return str(stage(src, scratch, name=name, checksums=spec.stage_checksums, log=log,
                         lock_timeout=spec.stage_timeout).path)
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


# ---- across nodes: the leaders, through the shared run dir ----

def poll_delays(nodes: int) -> Iterator[float]:
    """Seconds between a leader's polls of the run dir: 0.2 s, then 1.5 times longer each time, up to
    nodes / FS_POLLS_PER_S (at least 0.2 s, at most MAX_POLL_S), so that however many nodes wait, the
    job stats the shared filesystem about FS_POLLS_PER_S times per second at most."""
    cap = min(MAX_POLL_S, max(FIRST_POLL_S, nodes / FS_POLLS_PER_S))
    delay = FIRST_POLL_S
    while True:
        yield delay
        delay = min(delay * 1.5, cap)


def _attempt(env: Mapping[str, str]) -> str:
    return env.get("SLURM_RESTART_COUNT") or env.get("HPC_DDP_RESTART_COUNT") or "0"


def _all_nodes_ready(spec: JobSpec, dist: DistEnv, run_dir: Path, env: Mapping[str, str]) -> None:
    marks = run_dir / "stage" / f"{dist.job_id or 'job'}-{_attempt(env)}"
    marks.mkdir(parents=True, exist_ok=True)
    write_file(marks / f"node-{dist.node_rank}.json", json.dumps({"host": _host(dist, dist.node_rank)}))
    deadline = time.monotonic() + spec.stage_timeout
    for delay in poll_delays(dist.num_nodes):
        if _everyone_there(marks, dist):
            return
        if time.monotonic() > deadline:
            missing = _missing(marks, dist)  # node 0 may be the one missing, or gone: look for ourselves
            if not missing:
                return
            names = ", ".join(f"node {n} ({_host(dist, n)})" for n in missing)
            raise HpcDdpError(f"staging did not finish on {names} within {spec.stage_timeout} s",
                              hint=f"see local rank 0's log on that node ({RANK_LOGS_GLOB})")
        time.sleep(delay)


def _everyone_there(marks: Path, dist: DistEnv) -> bool:
    """One metadata operation: node 0 lists the marks (and says when all are there); the others look
    for that one word. Listing on every node would read O(nodes) entries per poll per node."""
    if dist.node_rank != 0:
        return (marks / "all-ready").exists()
    if _missing(marks, dist):
        return False
    (marks / "all-ready").touch()
    return True


def _missing(marks: Path, dist: DistEnv) -> list[int]:
    present = set(os.listdir(marks))
    return [n for n in range(dist.num_nodes) if f"node-{n}.json" not in present]


def _host(dist: DistEnv, node: int) -> str:
    return dist.hosts[node] if node < len(dist.hosts) else f"node{node}"


# ---- within a node: the leader tells the others, on the node's own disk ----

def _node_marks(scratch: Path, dist: DistEnv, env: Mapping[str, str]) -> list[Path]:
    """Where the leader may write the node's outcome: the scratch dir, or (when the scratch is unusable
    and the job reads the shared copy instead) the node's temp dir. Named by job, attempt and node, so
    neither a requeue nor simulated nodes sharing one disk (the local executor) read another's."""
    name = f".ready-{dist.job_id or 'job'}-{_attempt(env)}-node{dist.node_rank}.json"
    return list(dict.fromkeys([scratch / name, Path(tempfile.gettempdir()) / name]))


def _error_record(exc: Exception) -> dict:
    if isinstance(exc, HpcDdpError):
        return {"error": exc.message, "hint": exc.hint, "exit_code": exc.exit_code}
    return {"error": str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}", "exit_code": 1}


def _tell_node(marks: list[Path], record: dict, log: Callable[[str], None]) -> None:
    data = json.dumps(record).encode()
    problems = []
    for path in marks:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            replace_durable(path, data)
            return
        except OSError as exc:
            problems.append(f"{path.parent}: {exc.strerror or exc}")
    log(f"hpc-ddp stage: cannot tell this node's other ranks how staging went ({'; '.join(problems)}); "
        "they will wait for it until they time out")


def _follow(spec: JobSpec, marks: list[Path]) -> dict[str, str]:
    """A rank other than its node's leader: wait for the leader's word on the node's disk. The leader's
    own waits are bounded (each dataset's staging, then the barrier, by stage_timeout), so this one is
    their sum, and a grace."""
    limit = spec.stage_timeout * (len(spec.datasets) + 1) + LEADER_SILENT_GRACE_S
    deadline = time.monotonic() + limit
    while True:
        for path in marks:
            record = _read_mark(path)
            if record is not None:
                return _outcome(record)
        if time.monotonic() > deadline:
            names = ", ".join(name for name, _ in spec.datasets)
            raise StagingError(f"waited {limit:.0f} s for local rank 0 to stage {names} and to hear from every node",
                               hint=f"see local rank 0's log on this node ({RANK_LOGS_GLOB})")
        time.sleep(LOCAL_POLL_S)


def _read_mark(path: Path) -> dict | None:
    """The leader's record, or None while there is none. Only a regular file of this user's counts: in
    the temp dir anyone may create a file by that name."""
    try:
        info = os.lstat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return None
        record = json.loads(read_regular(path, limit=1 << 20))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and ("staged" in record or "error" in record) else None


def _outcome(record: dict) -> dict[str, str]:
    if "staged" in record:
        return {str(k): str(v) for k, v in record["staged"].items()}
    error = StagingError(str(record["error"]), hint=record.get("hint"))
    error.exit_code = int(record.get("exit_code") or 1)  # the leader's: a refused archive is the user's (2)
    raise error


def dataset_env(staged: Mapping[str, str], scratch: Path, spec: JobSpec) -> dict[str, str]:
    if not staged:
        return {}
    out = {"DATASETS_PATH": str(scratch), "DATASETS": ",".join(staged),
           "HPC_DDP_STAGED": json.dumps({src: staged[name] for name, src in spec.datasets})}
    out.update({f"HPC_DDP_DATA_{name.upper()}": path for name, path in staged.items()})
    return out
