"""Restarts inside the allocation (issue 44): the policy (`decide_restart`), what `end` answers the batch
script and records, the batch host's guard, and the batch script's loop run with stand-ins for srun."""

from __future__ import annotations

import json
import subprocess

import pytest

from hpc_ddp.job import attempts, hostguard
from hpc_ddp.job.attempts import Attempt, Limits, attempts_from_events, decide_restart


def _show(state: str, nodes: str) -> dict[str, str]:
    return {"JobState": state, "Restarts": "0", "NodeList": nodes}


def _spec_dir(tmp_path, **keys):
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec

    spec = build_spec([Layer("c", keys)], target=Target("script", "/t.py"), workdir="/", python="p")
    (tmp_path / "spec.json").write_text(json.dumps(spec.to_dict()))
    return tmp_path


def _events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def _trained(restarts=0, **kw) -> Attempt:
    return Attempt(0, 5, trainer=True, cause=kw.pop("cause", "failed"), restarts=restarts, **kw)


@pytest.mark.parametrize("last,healthy,min_nodes,step,ok,reason", [
    (_trained(), ["a", "b"], 2, 5, True, "failed: restart 1 of at most 2 in the allocation, on 2 node(s)"),
    (_trained(cause="node_failure"), ["a", "b", "d"], 2, 5, True, "node_failure: restart 1 of at most 2"),
    (_trained(cause="node_failure"), ["a"], 2, 5, False, "1 healthy node(s) left in the allocation, the job needs 2"),
    (_trained(restarts=2), ["a", "b"], 2, 9, False, "restarted in place 2 time(s) already, max_restarts=2"),
    (_trained(cause="preempted"), ["a", "b"], 2, 5, False, "preempted: the allocation ends"),
    (_trained(cause="time_limit"), ["a", "b"], 2, 5, False, "time_limit: the allocation ends"),
    (Attempt(0, None, started_at=0.0, ended_at=10.0, cause="failed"), ["a"], 1, None, False, "crash loop guard"),
    (Attempt(0, None, started_at=0.0, ended_at=90.0, cause="failed"), ["a"], 1, None, True, "restart 1"),  # a script
    (_trained(restarts=1, step_start_step=5), ["a", "b"], 2, 5, False, "no progress since the restart"),
    (_trained(restarts=1, step_start_step=5), ["a", "b"], 2, 8, True, "restart 2 of at most 2"),
])
def test_decide_restart(last, healthy, min_nodes, step, ok, reason):
    got = decide_restart(last, Limits(max_restarts=2), healthy=healthy, min_nodes=min_nodes, checkpoint_step=step)
    assert got[0] == ok and reason in got[1], got


def test_max_restarts_0_turns_them_off():
    assert decide_restart(_trained(), Limits(max_restarts=0), healthy=["a"], min_nodes=1, checkpoint_step=5) == \
        (False, "restarts inside the allocation are off (max_restarts=0)")


def test_a_restarted_record_starts_the_step_over_in_the_same_attempt():
    events = [{"event": "attempt_start", "attempt": 0, "time": 1.0, "nodes": "n[1-4]"}, {"event": "start", "time": 2.0},
              {"event": "signal", "cause": "preempted", "time": 3.0},
              {"event": "restarted", "attempt": 0, "nodes": "n1,n2,n4", "checkpoint_step": 6, "time": 4.0}]
    [a] = attempts_from_events(events)
    assert (a.restarts, a.trainer, a.cause, a.step_nodes, a.step_start_step, a.step_started_at) == \
        (1, False, None, "n1,n2,n4", 6, 4.0)


def test_a_crash_is_restarted_in_place_once_then_stops_as_before(tmp_path, monkeypatch):
    run_dir = _spec_dir(tmp_path, nodes=2, max_restarts=1)
    monkeypatch.setattr(attempts, "down_nodes", lambda nodes, run=None, silent=False: [])
    env = {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "hpcn[1-2]", "HPC_DDP_RESTART_STEP": "0"}
    assert attempts.begin(run_dir, 0, env=env)[0]
    for restart, word in ((0, "restart 2 hpcn1,hpcn2"), (1, "stop")):
        with open(run_dir / "events.jsonl", "a") as fh:
            fh.write(json.dumps({"event": "start", "time": 1}) + "\n")
        outcome = attempts.finish(run_dir, 0, 1, {**env, "HPC_DDP_RESTART_STEP": str(restart)},
                                  ask_slurm=lambda job: _show("RUNNING", "hpcn[1-2]"))
        assert outcome.word == word, outcome.reason
    records = _events(run_dir)
    [restarted] = [r for r in records if r["event"] == "restarted"]
    assert (restarted["cause"], restarted["restart"], restarted["nodes"], restarted["node_count"]) == \
        ("failed", 1, "hpcn1,hpcn2", 2)
    ends = [r for r in records if r["event"] == "attempt_end"]
    assert [(e["attempt"], e["cause"]) for e in ends] == [(0, "failed")]   # one attempt, ended once


def test_a_lost_node_of_a_range_restarts_on_the_nodes_left_and_not_for_a_fixed_size(tmp_path, monkeypatch):
    monkeypatch.setattr(attempts, "down_nodes", lambda nodes, run=None, silent=False: ["hpcn3"] if nodes == "hpcn[1-4]" else [])
    env = {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "hpcn[1-4]", "HPC_DDP_RESTART_STEP": "0"}
    for nodes, word in (("2-4", "restart 3 hpcn1,hpcn2,hpcn4"), ("4", "requeue")):
        (tmp_path / nodes).mkdir()
        run_dir = _spec_dir(tmp_path / nodes, nodes=nodes)
        assert attempts.begin(run_dir, 0, env=env)[0]
        outcome = attempts.finish(run_dir, 0, 137, env, ask_slurm=lambda job: _show("RUNNING", "hpcn[1-2,4]"))
        assert outcome.word == word, outcome.reason
    restarted = [r for r in _events(tmp_path / "2-4") if r["event"] == "restarted"]
    assert [(r["cause"], r["lost_nodes"], r["node_count"]) for r in restarted] == [("node_failure", "hpcn3", 3)]
    lost = [r for r in _events(tmp_path / "4") if r["event"] == "attempt_end"]
    assert lost[0]["cause"] == "node_failure" and lost[0]["nodes"] == "hpcn3"


@pytest.mark.parametrize("srun_args,word,reason", [
    # the user's --exclude: the restart never puts a rank there, even when it is healthy
    (["--exclude=hpcn4"], "restart 2 hpcn1,hpcn2", "on 2 node(s)"),
    (["--exclude=hpcn[1-2]"], "requeue", "1 healthy node(s) left in the allocation, the job needs 2"),
    # the user's --nodelist ("at least these"): kept when healthy, no restart in place when one is lost
    (["--nodelist=hpcn[1-2]"], "restart 3 hpcn1,hpcn2,hpcn4", "on 3 node(s)"),
    (["--nodelist=hpcn[2-3]"], "requeue", "pins node(s) hpcn3, not healthy in the allocation"),
    (["--nodelist=hpcn[1-2]", "--exclude=hpcn2"], "requeue", "pins node(s) hpcn2"),
    (["--label"], "restart 3 hpcn1,hpcn2,hpcn4", "on 3 node(s)"),
])
def test_a_restart_in_place_keeps_the_users_srun_node_pins(tmp_path, monkeypatch, capsys, srun_args, word, reason):
    """Issue 53: the restart's own --nodelist comes after the user's --srun-arg options and srun keeps the
    last one, so the nodes it names are chosen within the user's pins, or there is no restart in place."""
    monkeypatch.setattr(attempts, "down_nodes", lambda nodes, run=None, silent=False: ["hpcn3"])  # hpcn3 is lost
    env = {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "hpcn[1-4]", "HPC_DDP_RESTART_STEP": "0"}
    run_dir = _spec_dir(tmp_path, nodes="2-4", max_restarts=1, srun_args=srun_args)
    assert attempts.begin(run_dir, 0, env=env)[0]
    outcome = attempts.finish(run_dir, 0, 137, env, ask_slurm=lambda job: _show("RUNNING", "hpcn[1-2,4]"))
    said = outcome.reason + capsys.readouterr().err   # a refused restart is said on the batch log
    assert (outcome.word, reason in said) == (word, True), said


def test_srun_pins_read_files_as_srun_does_and_refuse_what_cannot_be_read(tmp_path):
    from hpc_ddp.job.restarts import Pins, srun_pins

    listed = tmp_path / "nodes"
    listed.write_text("hpcn1\nhpcn[3-4], hpcn6\n")
    assert srun_pins([f"--nodefile={listed}", "--exclude=hpcn5", "--mpi=none"]) == \
        Pins(frozenset({"hpcn1", "hpcn3", "hpcn4", "hpcn6"}), frozenset({"hpcn5"}))
    assert srun_pins([f"--exclude={listed}"]).exclude == {"hpcn1", "hpcn3", "hpcn4", "hpcn6"}  # a "/": a file
    assert "could not be read" in srun_pins([f"--nodefile={tmp_path / 'gone'}"]).unknown
    assert "could not be read" in srun_pins(["--nodelist=n[1-20000000]"]).unknown   # never expanded
    big = tmp_path / "big"
    big.write_bytes(b"n1 " * 400_000)
    assert "more than the 1,048,576" in srun_pins([f"--nodefile={big}"]).unknown


def test_without_the_scripts_word_nothing_restarts(tmp_path, monkeypatch):
    """A site's own template has no restart loop: it never hears `restart`."""
    run_dir = _spec_dir(tmp_path, nodes=2)
    monkeypatch.setattr(attempts, "down_nodes", lambda nodes, run=None, silent=False: [])
    env = {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "hpcn[1-2]"}
    assert attempts.begin(run_dir, 0, env=env)[0]
    with open(run_dir / "events.jsonl", "a") as fh:
        fh.write(json.dumps({"event": "start"}) + "\n")
    assert attempts.finish(run_dir, 0, 1, env, ask_slurm=lambda job: _show("RUNNING", "hpcn[1-2]")).word == "stop"


@pytest.mark.parametrize("nodes,batch,picked", [
    ("hpcn[1-4]", "hpcn1", "hpcn4"), ("hpcn1,hpcn2,hpcn4", "hpcn4", "hpcn2"), ("hpcn1", "hpcn1", None),
    ("hpcn[1-2]", "", None), ("bad[", "hpcn1", None),
])
def test_the_guard_runs_on_another_node_of_the_step(nodes, batch, picked):
    assert hostguard.pick(nodes, batch) == picked


def test_the_guard_requeues_the_job_when_the_batch_host_is_lost(tmp_path):
    calls, looks = [], iter([[], [], ["hpcn1"]])
    assert hostguard.watch(tmp_path, 0, "hpcn1", {"SLURM_JOB_ID": "7"}, lost=lambda node: next(looks),
                           silent=lambda node: [],
                           run=lambda argv, **_: calls.append(argv) or subprocess.CompletedProcess(argv, 0, "", ""),
                           sleep=lambda s: None)
    assert calls == [["scontrol", "requeue", "7"]]
    assert [(r["event"], r["node"]) for r in _events(tmp_path)] == [("batch_host_lost", "hpcn1")]
    assert not hostguard.watch(tmp_path, 0, "hpcn1", {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "2"},
                               lost=lambda node: [], silent=lambda node: [], run=lambda argv, **_: calls.append(argv),
                               sleep=lambda s: None, rounds=3)
    assert hostguard._target({"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "2"}) == "7_2"


def test_the_guard_asks_again_while_slurm_refuses_the_requeue(tmp_path, capsys):
    answers = iter([subprocess.CompletedProcess([], 1, "", "scontrol: error: Job is in a transitional state"),
                    subprocess.TimeoutExpired("scontrol", 60), subprocess.CompletedProcess([], 0, "", "")])
    calls = []

    def run(argv, **_):
        calls.append(argv)
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert hostguard.watch(tmp_path, 0, "hpcn1", {"SLURM_JOB_ID": "7"}, lost=lambda node: ["hpcn1"],
                           silent=lambda node: [], run=run, sleep=lambda s: None)
    assert calls == [["scontrol", "requeue", "7"]] * 3
    err = capsys.readouterr().err
    assert "try 1 of 24): scontrol: error: Job is in a transitional state" in err and "try 2 of 24)" in err
    assert "try 3" not in err


def test_the_batch_scripts_loop_restarts_the_ranks_on_the_nodes_it_is_told(tmp_path):
    """The rendered script's own lines, with stand-ins for srun and the policy: the first step fails, the
    policy answers restart on 3 nodes, the second srun gets --nodes, --ntasks and --nodelist, then stop."""
    from hpc_ddp.launch.render import render_sbatch
    from hpc_ddp.spec.jobspec import Layer, Target, build_spec

    spec = build_spec([Layer("c", {"nodes": "2-4", "tasks_per_node": 2})], target=Target("script", "/t.py"),
                      workdir=str(tmp_path), python="/opt/venv/bin/python")
    text = render_sbatch(spec, str(tmp_path / "run"), generated_at="x", command_line="x")
    assert "#SBATCH --no-kill" in text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\necho "srun $*" >> "$CALLS"\n'
                                  'sleep 0.3\ncase "$*" in *--overlap*) exec sleep 30;; *--nodelist=*) exit 0;; esac\nexit 9\n')
    (bin_dir / "python").write_text(
        '#!/bin/bash\necho "policy $* step=${HPC_DDP_RESTART_STEP-unset}" >> "$CALLS"\n'
        'case "$*" in *"attempts end"*" 9") echo "restart 3 n1,n2,n4";; *"attempts end"*) echo stop;;'
        ' *"hostguard pick"*) echo n4;; esac\n')
    for tool in ("srun", "python"):
        (bin_dir / tool).chmod(0o755)
    script = text.replace("/opt/venv/bin/python", str(bin_dir / "python"))
    calls = tmp_path / "calls"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), "SLURM_JOB_ID": "5",
                               "SLURM_JOB_NODELIST": "n[1-4]", "SLURMD_NODENAME": "n1"})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = calls.read_text().splitlines()
    ranks = [ln for ln in lines if ln.startswith("srun --kill-on-bad-exit")]
    assert len(ranks) == 2 and "--nodelist" not in ranks[0]
    assert "--nodes=3 --ntasks=6 --nodelist=n1,n2,n4 --open-mode=append" in ranks[1]
    guards = [ln for ln in lines if "--overlap" in ln]
    assert len(guards) == 2 and all("--nodelist=n4" in g and "--gpus-per-node=0" in g for g in guards)
    ends = [ln for ln in lines if "attempts end" in ln]
    assert [e.rsplit(" ", 2)[-2:] for e in ends] == [["9", "step=0"], ["0", "step=1"]]
    assert "restart 1 in this allocation" in done.stdout


class _Clock:
    """A clock the guard's sleeps move on."""
    def __init__(self):
        self.now = 0.0

    def sleep(self, seconds):
        self.now += seconds


def test_a_batch_host_that_misses_pings_for_a_while_is_not_lost(tmp_path):
    """Issue 53: the guard requeued a running job at its first look at a batch host that sinfo showed
    `mixed*` (one missed ping). Not responding for 30 s, then answering again: no requeue."""
    clock, calls = _Clock(), []
    quiet = iter([["hpcn1"]] * 6 + [[]] * 20)
    assert not hostguard.watch(tmp_path, 0, "hpcn1", {"SLURM_JOB_ID": "7"}, lost=lambda node: [],
                               silent=lambda node: next(quiet), run=lambda argv, **_: calls.append(argv),
                               sleep=clock.sleep, clock=lambda: clock.now, rounds=26)
    assert calls == [] and not (tmp_path / "events.jsonl").exists()


def test_a_batch_host_silent_past_the_grace_is_lost(tmp_path):
    clock, calls = _Clock(), []
    assert hostguard.watch(tmp_path, 0, "hpcn1", {"SLURM_JOB_ID": "7"}, lost=lambda node: [],
                           silent=lambda node: ["hpcn1"],
                           run=lambda argv, **_: calls.append(argv) or subprocess.CompletedProcess(argv, 0, "", ""),
                           sleep=clock.sleep, clock=lambda: clock.now, rounds=100)
    assert calls == [["scontrol", "requeue", "7"]] and clock.now == hostguard.SILENT_S


@pytest.mark.parametrize("state,lost,silent", [("mixed*", False, True), ("idle*", False, True),
                                               ("allocated*", False, True), ("down*", True, True),
                                               ("down", True, True), ("mixed", False, False)])
def test_not_responding_is_lost_only_where_asked_why_an_attempt_died(state, lost, silent):
    from hpc_ddp.slurm.jobview import lost_state

    assert lost_state(state) is lost and lost_state(state, silent=True) is silent


def test_a_node_file_that_is_a_fifo_is_refused_never_waited_on(tmp_path):
    import os

    from hpc_ddp.job.restarts import srun_pins

    os.mkfifo(tmp_path / "nodes")
    assert "could not be read" in srun_pins([f"--nodefile={tmp_path / 'nodes'}"]).unknown
