"""The cluster as sinfo describes it: partitions of nodes with their CPUs, memory, GPUs and time limits.

`parse_sinfo` (pure) turns one machine-readable sinfo listing into frozen values; `read_cluster` is the
edge that runs sinfo through a CommandRunner; `format_cluster` prints the table `hpc-ddp doctor` shows.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

from hpc_ddp.common.errors import HpcDdpError, SpecError
from hpc_ddp.common.procs import CommandRunner
from hpc_ddp.slurm.nodelist import compress_hostlist
from hpc_ddp.slurm.slurmtime import format_time, parse_time

__all__ = ["Node", "Partition", "Cluster", "Unavailable", "SINFO_ARGV", "parse_sinfo", "gres_gpus", "mem_mb",
           "read_cluster", "format_cluster", "limit_text", "one_line"]

# One line per (partition, node): partition (`*` marks the default), its state and time limit, then the
# node's name, state, CPUs, memory (MB) and generic resources.
SINFO_FORMAT = "%P|%a|%l|%N|%t|%c|%m|%G"
# --all: partitions marked Hidden are still open to the users allowed in them.
SINFO_ARGV = ("sinfo", "--all", "--noheader", "--Node", f"--format={SINFO_FORMAT}")
# A node in one of these states takes no new jobs (`*` after a state: not responding).
_DEAD_STATES = {"down", "drain", "drained", "drng", "draining", "fail", "failg", "failing", "futr", "future",
                "inval", "invalid", "unk", "unknown", "npc", "maint"}

@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    state: str
    cpus: int
    mem_mb: int
    gpus: int
    gres: str = ""

    @property
    def usable(self) -> bool:
        return not self.state.endswith("*") and self.state.rstrip("*~#!%$@^-+").lower() not in _DEAD_STATES


@dataclasses.dataclass(frozen=True)
class Partition:
    name: str
    nodes: tuple[Node, ...]
    max_time: int | None = None  # seconds; None: no limit
    default: bool = False
    state: str = "up"

    @property
    def usable_nodes(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.usable)


@dataclasses.dataclass(frozen=True)
class Cluster:
    partitions: tuple[Partition, ...]

    def get(self, name: str) -> Partition | None:
        return next((p for p in self.partitions if p.name == name), None)

    @property
    def default(self) -> Partition | None:
        return next((p for p in self.partitions if p.default), None)


def parse_sinfo(text: str) -> Cluster:
    """`sinfo --noheader --Node --format=SINFO_FORMAT` output -> Cluster, the default partition first."""
    heads: dict[str, tuple[bool, str, int | None]] = {}
    nodes: dict[str, list[Node]] = {}
    for line in filter(None, (ln.strip() for ln in text.splitlines())):
        fields = line.split("|")
        if len(fields) != 8:
            raise ValueError(f"unexpected sinfo line {line!r} (wanted 8 |-separated fields)")
        part, avail, limit, name, state, cpus, mem, gres = fields
        default, part = part.endswith("*"), part.rstrip("*")
        heads.setdefault(part, (default, avail, _time_limit(limit)))
        nodes.setdefault(part, []).append(Node(name, state, _leading_int(cpus), _leading_int(mem),
                                               gres_gpus(gres), gres))
    order = sorted(heads, key=lambda p: (not heads[p][0], p))  # the default first; sinfo's order varies
    return Cluster(tuple(Partition(p, tuple(nodes[p]), heads[p][2], heads[p][0], heads[p][1]) for p in order))


def gres_gpus(gres: str) -> int:
    """GPUs in a node's gres: `gpu:2` -> 2, `gpu:a100:4(S:0-1),shard:8` -> 4, `gpu:a:2,gpu:b:1` -> 3,
    `(null)` -> 0. A gpu entry without a count is one GPU."""
    total = 0
    for item in re.sub(r"\([^)]*\)", "", gres).split(","):  # drop socket/index annotations first
        parts = item.strip().split(":")
        if parts[0] == "gpu":
            total += int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return total


def mem_mb(mem: str | None) -> int | None:
    """A spec's --mem (`64G`, `4000M`, `4000`: MB) -> MB; None for no request or `0` (all of a node)."""
    if not mem:
        return None
    m = re.fullmatch(r"(\d+)([KMGT]?)", mem.upper())
    if not m:
        raise ValueError(f"not a Slurm memory size: {mem!r}")
    mb = int(m.group(1)) * {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 ** 2}[m.group(2)]
    return math.ceil(mb) or None


def _time_limit(text: str) -> int | None:
    try:
        return parse_time(text)
    except SpecError:  # "n/a" and the like: no limit we can check; sbatch still enforces the real one
        return None


def _leading_int(text: str) -> int:
    m = re.match(r"\d+", text.strip())  # aggregated forms print "4+"; a missing value counts as 0
    return int(m.group()) if m else 0


def limit_text(seconds: int | None) -> str:
    return "infinite" if seconds is None else format_time(seconds)



class Unavailable(HpcDdpError):
    """The cluster could not be read: its checks are skipped, with a warning."""


def read_cluster(commands: CommandRunner, environ: Mapping[str, str]) -> Cluster:
    if commands.which("sinfo") is None:
        raise Unavailable("sinfo is not on PATH")
    # SINFO_PARTITION and friends would filter or reshape what we parse.
    env = {k: v for k, v in environ.items() if not k.startswith("SINFO_")}
    try:
        done = commands.run(SINFO_ARGV, env=env, timeout=30)
    except HpcDdpError as exc:  # not found, or no answer in time
        raise Unavailable(str(exc.message)) from None
    if done.returncode != 0:
        raise Unavailable(f"sinfo failed: {one_line(done.stderr or done.stdout) or done.returncode}")
    try:
        cluster = parse_sinfo(done.stdout)
    except ValueError as exc:
        raise Unavailable(str(exc)) from None
    if not cluster.partitions:
        raise Unavailable("sinfo lists no partitions")
    return cluster



def format_cluster(cluster: Cluster) -> list[str]:
    """A table of partitions: usable/total nodes, CPUs, memory, GPUs per node (min-max) and time limit."""
    rows = [("PARTITION", "STATE", "NODES", "CPUS", "MEMORY", "GPUS", "TIME LIMIT", "NODELIST")]
    for p in cluster.partitions:
        nodes = p.usable_nodes or p.nodes
        count = f"{len(p.usable_nodes)}/{len(p.nodes)}" if len(p.usable_nodes) != len(p.nodes) else str(len(p.nodes))
        rows.append((p.name + ("*" if p.default else ""), p.state, count, _span(n.cpus for n in nodes),
                     _span(n.mem_mb for n in nodes) + "M", _span(n.gpus for n in nodes), limit_text(p.max_time),
                     compress_hostlist([n.name for n in p.nodes])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]


def _span(values) -> str:
    values = list(values)
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


def one_line(text: str) -> str:
    return " ".join(text.split())

