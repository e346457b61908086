"""--debug-rank: the spec's checks, the debugger's argv, the tunnel line, what the rank prints and status shows."""

from __future__ import annotations

import sys

import pytest

from hpc_ddp.common.errors import SpecError, UserError
from hpc_ddp.job import debugger
from hpc_ddp.launch.status import debugger_lines
from hpc_ddp.spec.jobspec import JobSpec, Layer, Target, build_spec

TARGET = Target("script", "/abs/train.py")


def spec(**flags) -> JobSpec:
    return build_spec([Layer("command line", flags, is_cli=True)], target=TARGET, workdir="/w",
                      python=sys.executable)


def test_debug_rank_stretches_the_timeouts_and_keeps_longer_ones():
    s = spec(nodes="2", tasks_per_node="2", debug_rank="3")
    assert (s.debug_rank, s.debugger, s.debug_port) == (3, "debugpy", None)
    assert s.rendezvous_timeout == s.collective_timeout == debugger.DEBUG_TIMEOUT_S
    longer = spec(debug_rank="0", collective_timeout=str(3 * 86400))
    assert longer.collective_timeout == 3 * 86400
    plain = spec(nodes="2")
    assert (plain.rendezvous_timeout, plain.collective_timeout) == (300, 600)
    assert JobSpec.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(("flags", "message"), [
    ({"nodes": "2", "tasks_per_node": "2", "debug_rank": "4"}, "--debug-rank 4 is outside the job's 4 rank(s)"),
    ({"debug_rank": "-1"}, "--debug-rank"),
    ({"debugger": "pdb"}, "--pdb without --debug-rank"),
    ({"debug_port": "6000"}, "--debug-port without --debug-rank"),
    ({"debug_rank": "0", "debugger": "pdb", "executor": "sbatch"}, "--pdb opens pdb in this terminal"),
    ({"debug_rank": "0", "debug_port": "80"}, "--debug-port: 80 is not a port we can listen on"),
])
def test_bad_debug_settings_are_one_line(flags, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec(**flags)


def test_missing_debugpy_names_the_extra_at_the_submit_edge_not_when_the_spec_is_built(monkeypatch):
    asked: list[str] = []
    missing = {"now": False}
    monkeypatch.setattr(debugger, "debugpy_missing", lambda python: asked.append(python) or missing["now"])
    s = spec(debug_rank="0")  # building a spec (a dry run, render) asks nothing
    assert asked == []
    debugger.refuse_missing_debugpy([s, s, spec(debug_rank="0", nodes="2")])  # a sweep's tasks: one Python
    assert asked == [sys.executable]
    debugger.refuse_missing_debugpy([spec(), spec(debug_rank="0", debugger="pdb", executor="local")])
    assert asked == [sys.executable]  # no debugpy rank: nothing asked
    missing["now"] = True
    with pytest.raises(UserError) as err:
        debugger.refuse_missing_debugpy([s])
    assert "debugpy is not installed" in err.value.message and "pip install 'hpc-ddp[debug]'" in err.value.hint


def test_a_python_that_cannot_import_debugpy_is_missing(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    assert debugger.debugpy_missing(str(fake))
    assert not debugger.debugpy_missing(str(tmp_path / "not-here"))  # not runnable here: the rank checks


def test_argv_under_each_debugger():
    argv = ["/py", "-m", "pkg.train", "--lr", "1"]
    assert debugger.debug_argv(argv, "debugpy", "10.0.0.5", 5678) == [
        "/py", "-Xfrozen_modules=off", "-m", "debugpy", "--listen", "10.0.0.5:5678", "--wait-for-client", "-m", "pkg.train", "--lr", "1"]
    assert debugger.debug_argv(["/py", "/a/t.py"], "pdb", "", 0) == ["/py", "-m", "pdb", "/a/t.py"]


def test_tunnel_line_and_log_on_a_cluster_node():
    rec = debugger.record(3, "debugpy", "10.1.0.7", "hpcn1", 5678, "login1", 86400, 86400)
    assert rec["tunnel"] == "ssh -N -L 5678:hpcn1:5678 login1"
    lines = debugger.log_lines(rec)
    assert lines[0].startswith("hpc-ddp: rank 3 waits for a debugger (debugpy) on 10.1.0.7:5678;")
    assert "ssh -N -L 5678:hpcn1:5678 login1  then attach VS Code or PyCharm to localhost:5678" in lines[1]
    assert "anyone who can reach 10.1.0.7:5678" in lines[2]  # who can attach, said where the user looks


def test_listen_host_is_loopback_under_the_local_executor_else_the_node():
    assert debugger.listen_host({"HPC_DDP_LOCAL": "1"}) == ("127.0.0.1", "127.0.0.1")
    address, node = debugger.listen_host({"SLURMD_NODENAME": "localhost"})
    assert node == "localhost" and address.startswith("127.") and address != "0.0.0.0"


def test_wrap_changes_only_the_debug_rank():
    s = spec(nodes="2", tasks_per_node="2", debug_rank="1")
    said: list[str] = []
    argv = [sys.executable, "/abs/train.py"]
    assert debugger.wrap(s, 0, argv, {"HPC_DDP_LOCAL": "1"}, say=said.append) == (argv, None)
    wrapped, rec = debugger.wrap(s, 1, argv, {"HPC_DDP_LOCAL": "1"}, say=said.append)
    assert wrapped[2:5] == ["-m", "debugpy", "--listen"] and wrapped[5] == f"127.0.0.1:{rec['port']}"
    assert rec["event"] == "debugger" and rec["loopback"] and len(said) == 3


def test_status_shows_the_address_tunnel_and_timeouts():
    rec = debugger.record(3, "debugpy", "10.1.0.7", "hpcn1", 5679, "login1", 86400, 90000)
    assert debugger_lines(rec) == [
        "debugger         rank 3 waits for debugpy on 10.1.0.7:5679 (timeouts stretched: rendezvous 86400 s, "
        "collective 90000 s)",
        "  tunnel         ssh -N -L 5679:hpcn1:5679 login1  then attach to localhost:5679"]
