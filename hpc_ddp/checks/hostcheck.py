"""Can the ranks of a multi-node job reach rank 0 at MASTER_ADDR? (`hpc-ddp doctor`)

MASTER_ADDR is the first node of the job's allocation: any node of its partition. Where a node's name
resolves to a loopback address (a hosts-file line such as `127.0.1.1 node001`, which Debian writes for a
machine's own name), a rank on another node that looks it up connects to itself and waits out the
rendezvous timeout; gloo and NCCL, which look up each rank's own name, advertise the loopback address
to the others the same way.

The names are resolved here, on the login node, as the ranks would (getaddrinfo, the first address): the
compute nodes' own hosts files cannot be seen from here, and that is said. A one-machine cluster (the test
Slurm: hpcn1 and hpcn2 are 127.0.1.11 and 127.0.1.12 on this machine) is told apart by its addresses:
when every node's address belongs to this machine (a loopback address, or one a socket can bind to here),
every rank runs on this machine, where loopback does reach rank 0.

`master_addr_finding` is pure; `master_addr_check` reads the names through the edge (`resolve_name`,
`is_local_address`), which tests replace.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Mapping, Sequence

from hpc_ddp.checks.finding import Finding
from hpc_ddp.slurm.cluster import Cluster
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["master_addr_check", "master_addr_finding", "resolve_name", "is_local_address", "MAX_NODES_RESOLVED"]

MAX_NODES_RESOLVED = 64  # a look-up each: a big partition is sampled, and the sample is said


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def master_addr_finding(nodes: Sequence[str], partition: str, addresses: Mapping[str, str | None],
                        local: Callable[[str], bool]) -> Finding:
    """The finding for a multi-node job that may start on any of `nodes` (of `partition`). `addresses`:
    node -> the address its name resolves to here (None: it does not resolve); `local`: whether an address
    belongs to this machine."""
    checked = [n for n in nodes if n in addresses]
    sample = f" (the first {len(checked)} of {len(nodes)})" if len(checked) < len(nodes) else ""
    unresolved = [n for n in checked if addresses[n] is None]
    resolved = {n: addresses[n] for n in checked if addresses[n] is not None}
    loopback = {n: a for n, a in resolved.items() if is_loopback(a)}
    if resolved and not unresolved and all(local(a) for a in resolved.values()):
        shown = ", ".join(f"{n} {a}" for n, a in list(resolved.items())[:4])
        return Finding("ok", f"MASTER_ADDR: every node of partition {partition}{sample} resolves to an address of "
                       f"this machine ({shown}): a one-machine cluster, where loopback reaches rank 0")
    if loopback:
        node, address = next(iter(loopback.items()))
        more = f" (and {len(loopback) - 1} more)" if len(loopback) > 1 else ""
        return Finding("error", f"MASTER_ADDR: node {node}{more} of partition {partition} resolves to {address}, a "
                       "loopback address, here: if the job starts there, ranks on the other nodes connect to "
                       "themselves and wait out the rendezvous timeout",
                       hint=f"give {node} its network address in /etc/hosts or DNS (a `127.0.1.1 {node}` line is "
                            "Debian's default); setting GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME in the profile's env "
                            "picks the interface the ranks use, not what the name resolves to")
    if unresolved:
        return Finding("warning", f"MASTER_ADDR: {len(unresolved)} node name(s) of partition {partition} do not "
                       f"resolve here ({', '.join(unresolved[:4])}); the compute nodes may resolve them",
                       hint="check with `getent hosts NODE` on a compute node (srun -N1 getent hosts NODE)")
    return Finding("ok", f"MASTER_ADDR: every node of partition {partition}{sample} resolves to a network "
                   "address here, not loopback (as this machine resolves them; the compute nodes' hosts files "
                   "are not seen from here)")


# ---- the edge ----

def master_addr_check(spec: JobSpec, cluster: Cluster, resolve: Callable[[str], str | None] | None = None,
                      local: Callable[[str], bool] | None = None) -> Finding | None:
    """The MASTER_ADDR finding for `spec` on `cluster` (None for a one-node job, or no partition to read)."""
    names = (spec.partition or "").split(",")[0]
    part = cluster.get(names) if names else cluster.default
    if spec.nodes < 2 or part is None or not part.nodes:
        return None
    nodes = [n.name for n in part.nodes]
    lookup = resolve or resolve_name
    addresses = {name: lookup(name) for name in nodes[:MAX_NODES_RESOLVED]}
    return master_addr_finding(nodes, part.name, addresses, local or is_local_address)


def resolve_name(name: str) -> str | None:
    """The first address `name` resolves to, as a rank's connect would take it; None if it does not."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return None
    return str(infos[0][4][0]) if infos else None


def is_local_address(address: str) -> bool:
    """Whether `address` belongs to this machine: loopback, or a socket can bind to it here."""
    if is_loopback(address):
        return True
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False
