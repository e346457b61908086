"""The cluster's answers over ssh, read once into typed values (remote/answers.py, issue 53): each value of
its type or dropped, an answer a decision needs whole refused in one line, never a traceback."""

from __future__ import annotations

import json

import pytest

from hpc_ddp.common.errors import UserError
from hpc_ddp.remote.answers import (
    DebugTarget,
    LogEntry,
    parse_debug_target,
    parse_hello,
    parse_log_entry,
    parse_run_states,
    parse_submitted,
    parse_wrote,
)


def test_a_hello_reads_each_value_of_its_type_and_drops_the_rest():
    said = parse_hello("Welcome to the cluster! state=ours\nversion=hpc-ddp 1.0\nrsync=rsync  version 3.2.7\n"
                       "dir=/home/a/proj\nstate=empty\nfree_kb=123\nwritable=yes\n")
    assert (said.version, said.dir, said.state, said.free_kb, said.writable) == \
        ("hpc-ddp 1.0", "/home/a/proj", "empty", 123, True)   # the banner's line is overridden by the script's


@pytest.mark.parametrize("line,field,value", [
    ("version=missing", "version", None), ("version=   ", "version", None),
    ("dir=proj", "dir", None), ("dir=/a/\x1b[2Jb", "dir", None), ("dir=", "dir", None),
    ("state=weird", "state", None), ("mark=maybe", "mark", None), ("mark=link", "mark", "link"),
    ("free_kb=-5", "free_kb", None), ("free_kb=lots", "free_kb", None), ("free_kb=" + "9" * 400, "free_kb", None),
    ("free_kb=\u0661\u0662", "free_kb", None),   # Arabic-Indic digits: isdigit() says yes, int() would read them
    ("writable=no", "writable", False), ("writable=perhaps", "writable", True),
    ("unwritable=relative", "unwritable", None), ("rsync=\x1b]0;title\x07", "rsync", None),
])
def test_a_hostile_hello_value_is_dropped_not_obeyed(line, field, value):
    assert getattr(parse_hello(line + "\n"), field) == value


def _answer(**over):
    return {"executor": "sbatch", "job_id": "17", "run_dir": "/home/a/runs/train-20261205-010101", **over}


def test_a_submit_answer_is_read_into_job_ids_and_run_dirs():
    one = parse_submitted(_answer(), "c")
    assert (one.job_ids, one.run_dir, one.tasks) == (("17",), "/home/a/runs/train-20261205-010101", None)
    chain = parse_submitted(_answer(job_ids=["17", 18]), "c")
    assert chain.job_ids == ("17", "18")
    sweep = parse_submitted({"executor": "sbatch", "sweep_dir": "/s", "array_job_id": "9",
                             "tasks": [{"task": 0, "job_id": "9_0", "run_dir": "/s/t0", "values": {"lr": 1}}]}, "c")
    assert [(t.task, t.job_id, t.run_dir, dict(t.values)) for t in sweep.tasks] == [(0, "9_0", "/s/t0", {"lr": 1})]
    assert sweep.array_job_id == "9"


@pytest.mark.parametrize("answer,names", [
    ([], "a list, not a table"), ("17", "a str, not a table"),
    (_answer(job_id="--json"), "its run dir or job id"), (_answer(job_id="1\n2"), "its run dir or job id"),
    (_answer(job_id=True), "its run dir or job id"), (_answer(run_dir="runs/x"), "its run dir or job id"),
    (_answer(run_dir="/r/\x1b[2J"), "its run dir or job id"), (_answer(job_ids="17"), "its job ids"),
    (_answer(job_ids=[None]), "its job ids"), (_answer(executor=["x"]), "its executor"),
    ({"tasks": {"a": 1}}, "its tasks"), ({"tasks": [], "sweep_dir": "rel"}, "its sweep dir"),
    ({"tasks": [{"task": "0"}]}, "a task's job id, run dir, number or values"),
    ({"tasks": [{"values": [1]}]}, "a task's job id, run dir, number or values"),
])
def test_a_submit_answer_not_of_its_types_is_refused_in_one_line(answer, names):
    with pytest.raises(UserError) as err:
        parse_submitted(answer, "c")
    assert names in str(err.value) and "\n" not in str(err.value) and "hpc-ddp list" in err.value.hint


@pytest.mark.parametrize("raw,entry", [
    (json.dumps({"path": "p", "end": 5, "part": 0, "parts": 1, "line": "hi"}), LogEntry("p", 5, 0, 1, "hi")),
    (json.dumps({"path": "p", "end": 5, "part": 0, "parts": 1, "line": "x", "attempt": 1, "rank": 0}),
     LogEntry("p", 5, 0, 1, "x", 1, 0)),
    (b"\xff\xfe not json", None), ("[1, 2]", None), ("{}", None),
    (json.dumps({"path": "p", "end": -1, "part": 0, "parts": 1, "line": "x"}), None),
    (json.dumps({"path": "p", "end": True, "part": 0, "parts": 1, "line": "x"}), None),
    (json.dumps({"path": "p", "end": 1, "part": 0, "parts": 1, "line": "x", "rank": "0"}), None),
    ("9" * 5000, None),   # one huge number: not an entry (and no traceback)
])
def test_log_entries_of_their_types_only(raw, entry):
    assert parse_log_entry(raw) == entry


def _status(**debugger):
    return json.dumps({"state": "RUNNING", "debugger": {"node": "n1", "port": 5678, "login_socket": "/run/u/s",
                                                        "owner_only": True, "rank": 1, **debugger}})


@pytest.mark.parametrize("answer,target", [
    (_status(), DebugTarget("n1", 5678, "/run/u/s", 1)),
    (_status(rank="1"), DebugTarget("n1", 5678, "/run/u/s", None)),
    (_status(port=True), None), (_status(port=99999), None), (_status(port=0), None),
    (_status(login_socket="relative"), None), (_status(owner_only=1), None), (_status(node=""), None),
    (_status(node="n1\x1b[2J"), None), (json.dumps({"debugger": "n1:5678"}), None), ("not json", None),
    (json.dumps([1]), None),
])
def test_a_debugger_answer_is_tunnelled_only_when_every_value_is_of_its_type(answer, target):
    assert parse_debug_target(answer) == target


def test_run_states_keep_only_records_of_their_types():
    text = json.dumps([{"job_id": "5", "slurm": {"state": "RUNNING"}}, {"job_id": "--all", "slurm": {}},
                       {"job_id": 6, "slurm": "RUNNING"}, "junk", {"job_id": 7, "slurm": {"state": "PENDING"}}])
    assert parse_run_states(text) == {"5": {"state": "RUNNING"}, "7": {"state": "PENDING"}}
    for bad in ("{}", "not json", '"a"'):
        with pytest.raises(ValueError):
            parse_run_states(bad)


def test_a_remote_timeline_picture_is_an_absolute_printable_path():
    assert parse_wrote("summary\nWrote /r/run/timeline.png\n") == ("/r/run/timeline.png", ["summary"])
    assert parse_wrote("Wrote relative.png\nWrote /a\x1b[2J.png\n")[0] is None
    assert parse_wrote("nothing drawn\n") == (None, ["nothing drawn"])
