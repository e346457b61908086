"""doctor's MASTER_ADDR check: a multi-node job whose first node may resolve to loopback is an error, except on
a one-machine cluster (every node's address is this machine's), such as the test Slurm."""

import subprocess
import sys

import pytest

from hpc_ddp.checks.hostcheck import MAX_NODES_RESOLVED, is_local_address, master_addr_check, master_addr_finding
from hpc_ddp.slurm.cluster import Cluster, Node, Partition
from hpc_ddp.spec.jobspec import Layer, Target, build_spec

HERE = {"127.0.0.1", "127.0.1.11", "127.0.1.12", "10.0.0.5"}  # this machine's addresses, in these tests


def local(address: str) -> bool:
    return address in HERE


def finding(addresses: dict, nodes=None):
    return master_addr_finding(nodes or list(addresses), "gpu", addresses, local)


def test_a_one_machine_cluster_is_told_apart_and_passes():
    found = finding({"hpcn1": "127.0.1.11", "hpcn2": "127.0.1.12"})
    assert found.level == "ok" and "a one-machine cluster" in found.message and "hpcn1 127.0.1.11" in found.message


def test_a_node_that_resolves_to_loopback_on_a_real_cluster_is_an_error():
    found = finding({"gpu001": "127.0.1.1", "gpu002": "10.1.0.2", "gpu003": "10.1.0.3"})
    assert found.level == "error"
    assert "node gpu001 of partition gpu resolves to 127.0.1.1, a loopback address" in found.message
    assert "127.0.1.1 gpu001" in found.hint and "GLOO_SOCKET_IFNAME" in found.hint


def test_network_addresses_pass_and_say_what_was_not_seen():
    found = finding({"gpu001": "10.1.0.1", "gpu002": "10.1.0.2"})
    assert found.level == "ok" and "compute nodes' hosts files are not seen from here" in found.message


def test_names_that_do_not_resolve_here_are_a_warning():
    found = finding({"gpu001": None, "gpu002": "10.1.0.2"})
    assert found.level == "warning" and "gpu001" in found.message


def test_a_big_partition_is_sampled_and_says_so():
    nodes = [f"n{i}" for i in range(100)]
    found = finding({n: "10.2.0.1" for n in nodes[:MAX_NODES_RESOLVED]}, nodes)
    assert f"(the first {MAX_NODES_RESOLVED} of 100)" in found.message


def cluster(*names: str) -> Cluster:
    nodes = tuple(Node(name, "idle", 4, 4000, 2) for name in names)
    return Cluster((Partition("debug", nodes, default=True), Partition("gpu", nodes[:1])))


def spec(nodes: int, partition: str | None = None):
    values = {"nodes": nodes, **({"partition": partition} if partition else {})}
    return build_spec([Layer("c", values)], target=Target("script", "/t.py"), workdir="/", python="p")


def test_only_multi_node_jobs_are_checked_on_their_partition():
    table = {"a": "127.0.1.1", "b": "10.0.0.9"}
    assert master_addr_check(spec(1), cluster("a", "b"), table.get, local) is None
    assert master_addr_check(spec(2), cluster("a", "b"), table.get, local).level == "error"
    asked = []
    master_addr_check(spec(2, "gpu"), cluster("a", "b"), lambda n: asked.append(n) or "10.0.0.9", local)
    assert asked == ["a"]  # partition gpu holds node a only


def test_this_machines_addresses_are_local_and_others_are_not():
    assert is_local_address("127.0.1.11") and is_local_address("::1")
    assert not is_local_address("192.0.2.1")  # TEST-NET-1: never this machine's


@pytest.mark.slurm
def test_doctor_on_the_test_slurm_sees_one_machine(slurm_conf, tmp_path):
    (tmp_path / "t.py").write_text("pass\n")
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "doctor", "--nodes", "2", "t.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    line = next(ln for ln in done.stdout.splitlines() if "MASTER_ADDR" in ln)
    assert line.startswith("ok: MASTER_ADDR: every node of partition debug resolves to an address of this machine")
    assert "hpcn1 127.0.1.11" in line
