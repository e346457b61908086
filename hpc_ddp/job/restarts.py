"""Restarts inside the allocation: after a rank crashed or a node was lost, a new srun step on the nodes that
are left resumes from the last checkpoint, instead of a requeue (`job.attempts` calls this at an attempt's
end where the batch script says it can restart; `policy.decide_restart` decides)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.common.errors import HpcDdpError
from hpc_ddp.common.events import JsonLines, read_jsonl
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.job.policy import Attempt, decide_restart, limits_of
from hpc_ddp.slurm.nodelist import expand_hostlist

__all__ = ["restart_in_place"]


def restart_in_place(run_dir: Path, attempt: int, exit_code: int, last: Attempt, lost: list[str],
                     slurm: Mapping[str, str] | None, env: Mapping[str, str], spec, *,
                     lost_now: Callable[[str], list[str]], checkpoint_step: int | None) -> tuple[tuple[str, ...], str] | None:
    """The attempt's step ended with a crash or a lost node: (the nodes to restart on, why), recorded as a
    "restarted" event; or None where `decide_restart` says no (the usual rules go on). `lost_now`: the
    nodes of a hostlist Slurm holds lost now (`slurm.jobview.down_nodes`)."""
    try:  # the allocation as Slurm holds it now (with --no-kill a lost node has left it), less what is lost
        allocation = expand_hostlist((slurm or {}).get("NodeList") or last.step_nodes or env.get("SLURM_JOB_NODELIST")
                                     or "")
    except (ValueError, HpcDdpError):
        allocation = ()
    healthy = [n for n in allocation if n not in lost and n not in lost_now(",".join(allocation))] \
        if allocation else []
    limits = limits_of(spec)
    ok, reason = decide_restart(last, limits, healthy=healthy, min_nodes=spec.nodes, checkpoint_step=checkpoint_step)
    if not ok:
        if last.restarts or last.cause == "node_failure" or limits.max_restarts:
            print(f"hpc-ddp: not restarted in the allocation: {reason}", file=sys.stderr, flush=True)
        return None
    events = JsonLines(RunDir(run_dir).events)
    now = time.time()
    since = _last_progress(read_jsonl(RunDir(run_dir).events), last)
    events.write({"event": "restarted", "attempt": attempt, "restart": last.restarts + 1,
                  "cause": last.cause, "exit_code": exit_code,
                  "nodes": ",".join(healthy), "node_count": len(healthy),
                  **({"lost_nodes": ",".join(lost)} if lost else {}),
                  "checkpoint_step": checkpoint_step,
                  "seconds_lost": round(max(now - since, 0.0), 3) if since else None,
                  "reason": reason})
    return tuple(healthy), reason


def _last_progress(events: Sequence[dict[str, Any]], last: Attempt) -> float | None:
    """When the step that just ended last saved (its newest checkpoint record), else when it began: the
    work after that is lost, and the restart redoes it."""
    began = last.step_started_at if last.step_started_at is not None else last.started_at
    if began is None:
        return None
    saved = [e.get("time") for e in events if e.get("event") == "checkpoint"
             and isinstance(e.get("time"), (int, float)) and e["time"] >= began]
    return max(saved) if saved else began
