import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpc_ddp.common.errors import EnvError
from hpc_ddp.slurm.nodelist import compress_hostlist, expand_hostlist, expand_tasks_per_node

# (hostlist, expansion): every row was checked against `scontrol show hostnames` of Slurm 22.05,
# except the ones marked newer (text after the last bracket, which 22.05 refuses).
TABLE = [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-10]", [f"n{i}" for i in range(1, 11)]),
    ("n[01-10]", [f"n{i:02d}" for i in range(1, 11)]),
    ("n[001-10]", [f"n{i:03d}" for i in range(1, 11)]),
    ("n[1-010]", [f"n{i}" for i in range(1, 11)]),
    ("n[09-11]", ["n09", "n10", "n11"]),
    ("gpu[001-003,5],cpu07", ["gpu001", "gpu002", "gpu003", "gpu5", "cpu07"]),
    ("n[1,3-4],m5", ["n1", "n3", "n4", "m5"]),
    ("rack[0-1]_blade[0-1]", ["rack0_blade0", "rack0_blade1", "rack1_blade0", "rack1_blade1"]),
    ("h[1-2][3-4]", ["h13", "h14", "h23", "h24"]),
    ("x[0-1]_y[00-01]", ["x0_y00", "x0_y01", "x1_y00", "x1_y01"]),
    ("n1,n1", ["n1", "n1"]),
    ("[1-2]", ["1", "2"]),
    ("n-[1-2]", ["n-1", "n-2"]),
    ("n[3,1]", ["n3", "n1"]),
    ("a,,b", ["a", "b"]),
    ("a,b c", ["a", "b", "c"]),
    ("n[0008-10]", ["n0008", "n0009", "n0010"]),
    ("n[1]", ["n1"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),            # newer Slurm
    ("a[1-2]b[3-4]c", ["a1b3c", "a1b4c", "a2b3c", "a2b4c"]),  # newer Slurm
]


@pytest.mark.parametrize("hostlist,hosts", TABLE)
def test_expand_table(hostlist, hosts):
    assert list(expand_hostlist(hostlist)) == hosts


@pytest.mark.parametrize("bad", ["n[2-1]", "n[a-b]", "n[]", "n[1-2", "n1-2]", "n[[1-2]]", "n[1,,2]", "n[1-3]]"])
def test_invalid_hostlists_are_refused(bad):
    with pytest.raises(EnvError, match="invalid hostlist"):
        expand_hostlist(bad)


@pytest.mark.parametrize("spec,counts", [
    ("1", (1,)), ("4", (4,)), ("2(x3),1", (2, 2, 2, 1)), ("8(x2)", (8, 8)), ("1,2,3", (1, 2, 3)),
    ("2(x1)", (2,)),
])
def test_tasks_per_node(spec, counts):
    assert expand_tasks_per_node(spec) == counts


@pytest.mark.parametrize("bad", ["", "x", "2(x)", "2(3)", "-1", "2(x3"])
def test_tasks_per_node_refuses_garbage(bad):
    with pytest.raises(EnvError):
        expand_tasks_per_node(bad)


# ---- property test against the oracle ----

_prefix = st.text(alphabet="abcxyz-_", min_size=1, max_size=4)


@st.composite
def _range(draw):
    lo = draw(st.integers(0, 120))
    width = draw(st.integers(len(str(lo)), 4))
    lo_text = str(lo).zfill(width)
    if draw(st.booleans()):
        return lo_text
    hi = draw(st.integers(lo, lo + 15))
    return f"{lo_text}-{str(hi).zfill(draw(st.integers(len(str(hi)), 4)))}"


@st.composite
def _item(draw):
    # Slurm 22.05 refuses text after the last bracket group, so the oracle test ends on a bracket.
    groups = draw(st.integers(0, 2))
    text = draw(_prefix)
    for g in range(groups):
        text += "[" + ",".join(draw(st.lists(_range(), min_size=1, max_size=3))) + "]"
        if g < groups - 1:
            text += draw(_prefix)
    return text


hostlists = st.lists(_item(), min_size=1, max_size=3).map(",".join)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol (Slurm) is not installed here")
@settings(max_examples=150, deadline=None)
@given(hostlists)
def test_agrees_with_scontrol(slurm_conf_env, hostlist):
    oracle = subprocess.run(["scontrol", "show", "hostnames", "--", hostlist], capture_output=True, text=True,
                            env=slurm_conf_env, timeout=10)
    assert oracle.returncode == 0, oracle.stderr
    assert list(expand_hostlist(hostlist)) == oracle.stdout.split()


@pytest.fixture(scope="module")
def slurm_conf_env(tmp_path_factory):
    """scontrol only needs a readable config to expand hostlists; no daemon has to run."""
    import os

    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=oracle\nSlurmctldHost=localhost\nNodeName=n1 CPUs=1\n"
                    "PartitionName=p Nodes=n1\n")
    return {**os.environ, "SLURM_CONF": str(conf)}


# ---- compressing: hosts -> a hostlist that expands back to them ----

@pytest.mark.parametrize("hosts,hostlist", [
    (["hpcn1", "hpcn2"], "hpcn[1-2]"), (["n01", "n02", "n03", "n07", "gpu5"], "n[01-03,07],gpu5"),
    (["n9", "n10", "n11"], "n[9-11]"), (["n09", "n10"], "n09,n10"), (["login"], "login"),
    (["a1", "a1", "b"], "a1,b"), (["n3", "n1"], "n[1,3]"), (["n1-ib", "n2-ib"], "n1-ib,n2-ib"),
])
def test_compress_table(hosts, hostlist):
    assert compress_hostlist(hosts) == hostlist


@settings(max_examples=200, deadline=None)
@given(hostlists)
def test_compress_round_trips(hostlist):
    hosts = list(dict.fromkeys(expand_hostlist(hostlist)))
    assert sorted(expand_hostlist(compress_hostlist(hosts))) == sorted(hosts)


def test_a_hostlist_past_the_bound_is_refused_before_anything_is_expanded():
    """Issue 53: `n[1-20000000]` in a damaged record cost 13-29 s and 3.5 GB; now one error, at once."""
    import time

    from hpc_ddp.common.errors import EnvError
    from hpc_ddp.slurm.nodelist import MAX_HOSTS, expand_hostlist

    start = time.monotonic()
    for text in ("n[1-20000000]", "r[0-999]b[0-999]", "n[1-40000],m[1-40000]", "n[1-" + "9" * 400 + "]"):
        with pytest.raises(EnvError, match="names more than"):
            expand_hostlist(text)
    assert time.monotonic() - start < 1.0
    assert len(expand_hostlist(f"n[1-{MAX_HOSTS}]")) == MAX_HOSTS
    assert expand_hostlist("n[1-3]", limit=3) == ("n1", "n2", "n3")
