"""Slurm hostlists and task counts: `gpu[001-003,5],cpu07` <-> hosts, `2(x3),1` -> tasks per node.

Pure functions, no Slurm needed. The expansion agrees with `scontrol show hostnames` for every list
Slurm accepts (tested against it when it is installed), and also accepts text after the last bracket
group (`n[1-2]-ib`), which newer Slurm releases allow.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

from hpc_ddp.common.errors import EnvError

__all__ = ["expand_hostlist", "compress_hostlist", "expand_tasks_per_node"]

_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
# More hosts than any job has: a hostlist that expands past this (`n[1-20000000]` in a damaged record) is
# refused before a name is made, not expanded into gigabytes of memory.
MAX_HOSTS = 65536


def expand_hostlist(hostlist: str, limit: int = MAX_HOSTS) -> tuple[str, ...]:
    """Expand a Slurm hostlist into host names, in Slurm's order (duplicates kept, as Slurm does). More than
    `limit` names is an EnvError, found by counting before anything is expanded."""
    items = _split_top_level(hostlist)
    total = 0
    for item in items:
        total += _count_item(item, hostlist)
        if total > limit:
            raise EnvError(f"hostlist {hostlist[:80]!r}{'...' if len(hostlist) > 80 else ''} names more than "
                           f"{limit:,} hosts: not expanded")
    hosts: list[str] = []
    for item in items:
        hosts.extend(_expand_item(item, hostlist))
    return tuple(hosts)


def _count_item(item: str, whole: str) -> int:
    """How many names `item` expands to, without expanding it."""
    count = 1
    for piece in re.split(r"(\[[^\]]*\])", item):
        if piece.startswith("["):
            count *= sum(_range_size(rng, whole) for rng in piece[1:-1].split(","))
    return count


def _range_size(rng: str, whole: str) -> int:
    lo, sep, hi = rng.partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise EnvError(f"invalid hostlist {whole!r}: bad range {rng!r}")
    if not sep:
        return 1
    if int(hi) < int(lo):
        raise EnvError(f"invalid hostlist {whole!r}: range {rng!r} runs backwards")
    return int(hi) - int(lo) + 1


def compress_hostlist(hosts: Sequence[str]) -> str:
    """Host names -> a hostlist that expands back to them: `n01 n02 n03 n07 gpu5` -> `n[01-03,07],gpu5`.
    Zero-padded numbers keep their width; unpadded ones (n9, n10) share a group, as Slurm pads."""
    groups: dict[tuple[str, int], list[int]] = {}
    others = []
    for host in dict.fromkeys(hosts):
        m = re.fullmatch(r"(.*?)(\d+)", host)
        if m and "[" not in host and "]" not in host and "," not in host:
            width = len(m.group(2)) if m.group(2).startswith("0") else 0
            groups.setdefault((m.group(1), width), []).append(int(m.group(2)))
        else:
            others.append(host)
    out = []
    for (prefix, width), numbers in groups.items():
        body = ",".join(str(a).zfill(width) + (f"-{str(b).zfill(width)}" if b > a else "")
                        for a, b in _runs(sorted(numbers)))
        out.append(f"{prefix}[{body}]" if len(numbers) > 1 else f"{prefix}{body}")
    return ",".join(out + others)


def _runs(numbers: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], n)
        else:
            runs.append((n, n))
    return runs


def expand_tasks_per_node(spec: str) -> tuple[int, ...]:
    """`2(x3),1` -> (2, 2, 2, 1): Slurm's compressed tasks-per-node form."""
    counts: list[int] = []
    for part in spec.split(","):
        m = _TASKS_ITEM.match(part.strip())
        if not m:
            raise EnvError(f"cannot parse tasks per node {spec!r} (expected a form like '2(x3),1')")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return tuple(counts)


def _split_top_level(hostlist: str) -> list[str]:
    """Split on commas and whitespace that are outside brackets; drop empty items (as Slurm does)."""
    items, depth, current = [], 0, []
    for ch in hostlist:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise EnvError(f"invalid hostlist {hostlist!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise EnvError(f"invalid hostlist {hostlist!r}: ']' without '['")
        if depth == 0 and (ch == "," or ch.isspace()):
            items.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth:
        raise EnvError(f"invalid hostlist {hostlist!r}: '[' without ']'")
    items.append("".join(current))
    return [item for item in items if item]


def _expand_item(item: str, whole: str) -> list[str]:
    """`rack[0-1]_blade[0-1]` -> the Cartesian product of its bracket groups, first group outermost."""
    pieces = re.split(r"(\[[^\]]*\])", item)
    choices = [_expand_brackets(p[1:-1], whole) if p.startswith("[") else [p] for p in pieces]
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_brackets(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for rng in body.split(","):
        lo, sep, hi = rng.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise EnvError(f"invalid hostlist {whole!r}: bad range {rng!r}")
        if not sep:
            out.append(lo)
            continue
        start, stop = int(lo), int(hi)
        if stop < start:
            raise EnvError(f"invalid hostlist {whole!r}: range {rng!r} runs backwards")
        # Slurm pads every number to the width of the range's lower bound as written.
        out.extend(str(n).zfill(len(lo)) for n in range(start, stop + 1))
    return out
