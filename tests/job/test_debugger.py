"""--debug-rank: the spec's checks, the debugger's argv, the tunnel line, what the rank prints and status shows."""

from __future__ import annotations

import os
import sys

import pytest

from hpc_ddp.common.errors import SpecError, UserError
from hpc_ddp.job import debugger, debugrelay
from hpc_ddp.spec.jobspec import JobSpec, Layer, Target, build_spec
from hpc_ddp.watch.status import debugger_lines

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


def test_argv_under_each_debugger_connects_debugpy_to_the_relay_and_never_listens():
    argv = ["/py", "-m", "pkg.train", "--lr", "1"]
    assert debugger.debug_argv(argv, "debugpy", 40123) == [
        "/py", "-Xfrozen_modules=off", "-m", "debugpy", "--connect", "127.0.0.1:40123", "--wait-for-client",
        "--configure-subProcess", "false", "-m", "pkg.train", "--lr", "1"]
    assert debugger.debug_argv(["/py", "/a/t.py"], "pdb", 0) == ["/py", "-m", "pdb", "/a/t.py"]


CLUSTER = debugrelay.Ready(40123, None, "/tmp/hpc-ddp-1000/rank-55-3.sock")


def _cluster_record(**extra):
    return debugger.record(3, "debugpy", 86400, 90000, node="hpcn1", job_id="55", login="login1", ready=CLUSTER,
                           python="/venv/bin/python", slurm_job_id="55", **extra)


def test_on_a_cluster_the_log_says_the_login_node_command_and_the_laptop_tunnel():
    rec = _cluster_record()
    at_login = debugrelay.login_socket_path("55", 3)
    assert rec["tunnel"] == f"ssh -N -L 5678:{at_login} login1" and rec["attach"] == "hpc-ddp attach 55"
    assert rec["owner_only"] and not rec["loopback"] and rec["socket"] == CLUSTER.socket
    lines = debugger.log_lines(rec)
    assert lines[0].startswith(f"hpc-ddp: rank 3 waits for a debugger (debugpy) on hpcn1, reachable only by you "
                               f"(uid {os.getuid()}) through srun;")
    assert lines[1] == "hpc-ddp: on the login node run: hpc-ddp attach 55  (leave it running: it relays to this rank)"
    assert lines[2] == (f"hpc-ddp: then from your laptop: ssh -N -L 5678:{at_login} login1  and attach VS Code or "
                        "PyCharm to localhost:5678")
    assert _cluster_record(laptop_port=6000)["tunnel"].startswith("ssh -N -L 6000:")  # --debug-port N


def test_under_the_local_executor_the_ide_port_is_on_loopback():
    rec = debugger.record(1, "debugpy", 86400, 86400, node="vm", job_id="local-1", login="vm",
                          ready=debugrelay.Ready(40123, 5679, "/tmp/s.sock"), python="/py")
    assert (rec["listen"], rec["port"], rec["loopback"]) == ("127.0.0.1:5679", 5679, True)
    assert rec["tunnel"] == "ssh -N -L 5679:127.0.0.1:5679 vm"
    assert "which takes only your own connections" in debugger.log_lines(rec)[0]


def test_wrap_changes_only_the_debug_rank_and_starts_its_relay_first(tmp_path, monkeypatch):
    s = spec(nodes="2", tasks_per_node="2", debug_rank="1")
    started: list[tuple] = []
    monkeypatch.setattr(debugger, "start", lambda path, port, local: started.append((path, port, local)) or
                        debugrelay.Ready(40123, 5680 if local else None, path))
    said: list[str] = []
    argv = [sys.executable, "/abs/train.py"]
    assert debugger.wrap(s, 0, argv, {"HPC_DDP_LOCAL": "1"}, say=said.append) == (argv, None)
    assert started == []
    wrapped, rec = debugger.wrap(s, 1, argv, {"HPC_DDP_LOCAL": "1"}, say=said.append, job_id="local-7")
    assert started == [(debugrelay.node_socket_path("local-7", 1), None, True)]
    assert wrapped[2:6] == ["-m", "debugpy", "--connect", "127.0.0.1:40123"]
    assert rec["event"] == "debugger" and rec["loopback"] and rec["port"] == 5680 and len(said) == 2
    wrapped, rec = debugger.wrap(s, 1, argv, {"SLURM_JOB_ID": "77", "SLURMD_NODENAME": "n3"}, say=said.append,
                                 job_id="77")
    assert started[-1] == (debugrelay.node_socket_path("77", 1), None, False)  # no TCP port for an IDE on a node
    assert rec["node"] == "n3" and rec["attach"] == "hpc-ddp attach 77" and rec["slurm_job_id"] == "77"
    _, rec = debugger.wrap(s, 1, argv, {"SLURM_JOB_ID": "78", "SLURM_ARRAY_JOB_ID": "70",
                                        "HPC_DDP_RUN_DIR": "/p/sweep/task-1"}, say=said.append, job_id="78")
    assert rec["attach"] == "hpc-ddp attach /p/sweep/task-1"  # a sweep's task: its run dir, which resolves


def test_status_shows_where_it_waits_and_the_commands_to_attach():
    assert debugger_lines(_cluster_record()) == [
        "debugger         rank 3 waits for debugpy on hpcn1, your connections only (timeouts stretched: rendezvous "
        "86400 s, collective 90000 s)",
        "  attach         hpc-ddp attach 55  (on the login node; leave it running: it relays through srun)",
        f"  tunnel         ssh -N -L 5678:{debugrelay.login_socket_path('55', 3)} login1  then attach to "
        "localhost:5678"]
    old = {"rank": 3, "debugger": "debugpy", "listen": "10.1.0.7:5679", "port": 5679, "rendezvous_timeout": 1,
           "collective_timeout": 2, "tunnel": "ssh -N -L 5679:hpcn1:5679 login1"}  # an older hpc-ddp's event
    assert debugger_lines(old)[1] == "  tunnel         ssh -N -L 5679:hpcn1:5679 login1  then attach to localhost:5679"
