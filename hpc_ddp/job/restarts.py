"""Restarts inside the allocation: after a rank crashed or a node was lost, a new srun step on the nodes that
are left resumes from the last checkpoint, instead of a requeue (`job.attempts` calls this at an attempt's
end where the batch script says it can restart; `policy.decide_restart` decides).

The restart's srun names its nodes (`--nodelist`), after the user's own `--srun-arg` options, and srun keeps
the last `--nodelist` it is given. So the user's pins are honoured here, where the nodes are chosen
(`srun_pins`): `--exclude` nodes are never restarted on, and every node of a `--nodelist` or `--nodefile`
must still be healthy, or there is no restart in place (the usual rules go on: a requeue)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.common.durable import read_bounded
from hpc_ddp.common.errors import HpcDdpError
from hpc_ddp.common.events import JsonLines, read_jsonl
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.job.policy import Attempt, decide_restart, limits_of
from hpc_ddp.slurm.nodelist import expand_hostlist

__all__ = ["Pins", "restart_in_place", "srun_pins"]

MAX_NODEFILE_BYTES = 1 << 20   # a node file longer than any allocation's list is not read


@dataclass(frozen=True)
class Pins:
    """What the user's srun options say of the ranks' nodes: every one of `include` runs ranks (srun's
    --nodelist/--nodefile: "at least these"), none of `exclude` does; `unknown` says why they could not be
    read (then no restart in place: hpc-ddp cannot tell which nodes the user allows)."""
    include: frozenset[str] = frozenset()
    exclude: frozenset[str] = frozenset()
    unknown: str | None = None


def srun_pins(srun_args: Sequence[str], read: Callable[[str], str] | None = None) -> Pins:
    """The node pins among `srun_args` (the spec's --srun-arg options, long forms: slurmargs checks them).
    A --nodelist or --exclude value with a "/" is a file, as srun reads it; so is --nodefile's."""
    read = read or _read_node_file
    include: set[str] = set()
    exclude: set[str] = set()
    for arg in srun_args:
        name, _, value = str(arg)[2:].partition("=")
        if name not in ("nodelist", "nodefile", "exclude"):
            continue
        try:
            words = read(value).replace(",", " ").split() if name == "nodefile" or "/" in value else [value]
            hosts = [h for word in words for h in expand_hostlist(word)]
        except (OSError, ValueError, HpcDdpError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            return Pins(unknown=f"--srun-arg={arg}: its nodes could not be read ({why})")
        (exclude if name == "exclude" else include).update(hosts)
    return Pins(frozenset(include), frozenset(exclude))


def _read_node_file(path: str) -> str:
    """A node file as srun reads it: a regular file only (a FIFO in its place is refused, never waited on),
    at most MAX_NODEFILE_BYTES."""
    return read_bounded(path, MAX_NODEFILE_BYTES).decode("ascii")


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
    pins = srun_pins(getattr(spec, "srun_args", ()) or ())
    healthy = [n for n in healthy if n not in pins.exclude]   # the user's --exclude: never a rank there
    limits = limits_of(spec)
    ok, reason = decide_restart(last, limits, healthy=healthy, min_nodes=spec.nodes, checkpoint_step=checkpoint_step)
    refused = _refused_by(pins, healthy, last) if ok else None
    if refused:
        ok, reason = False, refused
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


def _refused_by(pins: Pins, healthy: Sequence[str], last: Attempt) -> str | None:
    """Why the user's srun pins allow no restart on `healthy`, or None."""
    cause = last.cause or "failed"
    if pins.unknown:
        return f"{cause}: {pins.unknown}"
    missing = sorted(pins.include - set(healthy))
    if missing:
        return (f"{cause}: the ranks' --srun-arg pins node(s) {','.join(missing)}, not healthy in the allocation "
                "(or also excluded)")
    return None


def _last_progress(events: Sequence[dict[str, Any]], last: Attempt) -> float | None:
    """When the step that just ended last saved (its newest checkpoint record), else when it began: the
    work after that is lost, and the restart redoes it."""
    began = last.step_started_at if last.step_started_at is not None else last.started_at
    if began is None:
        return None
    saved = [e.get("time") for e in events if e.get("event") == "checkpoint"
             and isinstance(e.get("time"), (int, float)) and e["time"] >= began]
    return max(saved) if saved else began
