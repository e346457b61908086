"""Goodput (ETTR, effective training time ratio): the share of the node time a run held that went into
training it kept. Pure; built on `timeline` (the same records, the same definitions).

    allocated node-seconds: each attempt from its attempt_start to its attempt_end record (the last record
        where it has none), x the nodes it held; after a restart in place, x the nodes of the new srun step
        (Slurm released the lost node);
    useful node-seconds: each srun step of an attempt from its first training record (start/resume) to its
        last step record or checkpoint, less the steps a later step or attempt redid x the median step time,
        x its nodes;
    goodput = useful / allocated.

What is not useful: start-up (imports, the rendezvous, loading the checkpoint), a restart's or a requeue's
gap, work lost since the last checkpoint, and the final checkpoint. Queue waits are not allocated time and do
not count either way. A local run counts as one node.
"""

from __future__ import annotations

import dataclasses

from hpc_ddp.watch.timeline import Span, Timeline

__all__ = ["Goodput", "goodput", "goodput_line"]


@dataclasses.dataclass(frozen=True)
class Goodput:
    allocated_node_s: float
    useful_node_s: float

    @property
    def ratio(self) -> float | None:
        return self.useful_node_s / self.allocated_node_s if self.allocated_node_s > 0 else None


def _node_count(nodes: str | None) -> int:
    if not nodes:
        return 1
    from hpc_ddp.common.errors import HpcDdpError
    from hpc_ddp.slurm.nodelist import expand_hostlist

    try:
        return max(len(expand_hostlist(nodes)), 1)
    except (ValueError, HpcDdpError):
        return 1


def _segments(span: Span, redone_after: int, step_s: float) -> list[tuple[float, float, int]]:
    """(allocated seconds, useful seconds, nodes) of each srun step of the attempt `span`."""
    nodes = _node_count(span.nodes)
    starts = [span.start] + [r.time for r in span.restarts]
    ends = [r.time for r in span.restarts] + [span.end]
    train_from = [span.train_start] + [r.resumed_at for r in span.restarts]
    train_to = [r.trained_until for r in span.restarts] + [span.trained_until]
    redone = [r.redone_steps for r in span.restarts] + [redone_after]
    counts = [nodes] + [r.node_count or nodes for r in span.restarts]
    out = []
    for a, b, t0, t1, lost, n in zip(starts, ends, train_from, train_to, redone, counts):
        useful = max(t1 - t0, 0.0) if t0 is not None and t1 is not None and t1 >= a else 0.0
        out.append((max(b - a, 0.0), max(useful - lost * step_s, 0.0), n))
    return out


def goodput(timeline: Timeline) -> Goodput:
    step_s = timeline.step_seconds or 0.0
    allocated = useful = 0.0
    spans = timeline.spans
    for i, span in enumerate(spans):
        redone_after = spans[i + 1].redone_steps if i + 1 < len(spans) else 0
        for alloc_s, useful_s, n in _segments(span, redone_after, step_s):
            allocated += alloc_s * n
            useful += min(useful_s, alloc_s) * n
    return Goodput(allocated, useful)


def goodput_line(g: Goodput, gpus_per_node: int = 0) -> str | None:
    """'93% of allocated GPU time (41 h 12 min of 44 h 18 min trained and kept)'; None before anything ran."""
    from hpc_ddp.watch.timeline import duration

    if g.ratio is None:
        return None
    unit = "GPU" if gpus_per_node else "node"
    scale = gpus_per_node or 1
    return (f"{g.ratio:.0%} of allocated {unit} time ({duration(g.useful_node_s * scale)} of "
            f"{duration(g.allocated_node_s * scale)} trained and kept)")
