"""The notebook launcher against hostile but realistic use (issue 30): a function's subprocesses never outlive
its call, bad arguments are one line naming the fix before any rank starts, and a `submit()` that sbatch
refuses leaves nothing behind that would refuse the retry."""

from __future__ import annotations

import math
import os
import signal
import sys
from pathlib import Path

import pytest

from hpc_ddp import notebook
from hpc_ddp.common.errors import UserError
from hpc_ddp.launch import spawn


def cell(source: str, name: str = "f"):
    """A function defined as in a notebook cell (module __main__): it travels by value."""
    namespace = {"__name__": "__main__"}
    exec(compile(source, "<cell>", "exec"), namespace)
    return namespace[name]


# Each rank starts a child in its group and one in a session of its own, notes their pids, then ends as told.
LEAVES = cell("""
import os, subprocess, time
def f(folder, how):
    rank = os.environ["RANK"]
    kids = [subprocess.Popen(["sleep", "1000"]), subprocess.Popen(["setsid", "sleep", "1000"])]
    with open(os.path.join(folder, ".pids-" + rank), "w") as fh:
        fh.write(" ".join(str(k.pid) for k in kids) + " " + str(os.getpid()))
    os.replace(os.path.join(folder, ".pids-" + rank), os.path.join(folder, "pids-" + rank))
    if how == "raise" and rank == "1":
        for _ in range(600):  # once rank 0 has started its children too
            if os.path.exists(os.path.join(folder, "pids-0")):
                break
            time.sleep(0.05)
        raise ValueError("rank 1 gives up")
    return rank
""")


@pytest.fixture(autouse=True)
def short_graces(monkeypatch):
    monkeypatch.setattr(spawn, "FAILURE_GRACE_S", 0.5)
    monkeypatch.setattr(spawn, "TERM_GRACE_S", 1.0)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the supervisor is Linux's")
@pytest.mark.parametrize("how", ["return", "raise"])
def test_a_functions_subprocesses_end_with_the_call(tmp_path, how):
    pids = []
    try:
        if how == "raise":
            with pytest.raises(notebook.RankError, match="rank 1 gives up"):
                notebook.launch(LEAVES, str(tmp_path), how, nprocs=2, echo=False)
        else:
            assert notebook.launch(LEAVES, str(tmp_path), how, nprocs=2, echo=False) == "0"
        pids = [int(w) for path in tmp_path.glob("pids-*") for w in path.read_text().split()]
        assert len(pids) == 6
        assert [p for p in pids if alive(p)] == []
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


NEVER_CALLED = cell("def f():\n    raise AssertionError('no rank may start')\n")


@pytest.mark.parametrize("kwargs, says", [
    ({"timeout": "5"}, "timeout='5': give the seconds the ranks may run, a number above 0"),
    ({"timeout": math.nan}, "timeout=nan: "),
    ({"timeout": math.inf}, "timeout=inf: "),
    ({"timeout": 0}, "timeout=0: "),
    ({"timeout": -1.5}, "timeout=-1.5: "),
    ({"timeout": True}, "timeout=True: "),
    ({"env": {"X": 1}}, "env['X']=1: a variable's value is a string HINT: write env={'X': '1'}"),
    ({"env": {"X": None}}, "env['X']=None: a variable's value is a string"),
    ({"env": {1: "x"}}, "env: 1 is not a variable name"),
    ({"env": {"A=B": "x"}}, "env: 'A=B' is not a variable name"),
    ({"env": ["X=1"]}, "env=['X=1']: give a dict of variable names to values"),
])
def test_bad_launch_arguments_are_one_line_naming_the_fix(tmp_path, kwargs, says):
    with pytest.raises(UserError) as caught:
        notebook.launch(NEVER_CALLED, nprocs=1, run_dir=tmp_path / "run", echo=False, **kwargs)
    text = str(caught.value)
    assert text.startswith(says) and "\n" not in text and caught.value.hint, text
    assert not (tmp_path / "run").exists()  # refused before anything was made


def test_a_good_timeout_and_env_still_work(tmp_path):
    f = cell("import os\ndef f():\n    return os.environ['GREETING']\n")
    assert notebook.launch(f, nprocs=1, timeout=60.0, env={"GREETING": "hi"}, echo=False) == "hi"


def test_result_refuses_a_nan_timeout_instead_of_waiting_for_ever():
    call = notebook.SlurmCall("1", "/nonexistent", 1)
    with pytest.raises(UserError, match=r"^timeout=nan: "):
        call.result(timeout=math.nan)


# ---- notebook.submit when sbatch refuses the job ----

@pytest.fixture
def refusing_sbatch(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid partition name specified' >&2\n"
                      "exit 1\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)


def _refused(run_dir: Path) -> Exception:
    with pytest.raises(Exception) as caught:  # noqa: PT011 - whatever submitit raises for sbatch's refusal
        notebook.submit(NEVER_CALLED, partition="nope", run_dir=run_dir)
    return caught.value


@pytest.mark.parametrize("parent", ["", "deeper/still/"])
def test_a_refused_submit_leaves_no_run_dir_and_a_retry_is_not_refused(tmp_path, refusing_sbatch, parent):
    run_dir = tmp_path / f"{parent}run"
    for _ in range(2):  # the retry meets the same sbatch error, not "already holds a call"
        error = _refused(run_dir)
        assert "Invalid partition" in str(error) and not isinstance(error, UserError), error
        assert not run_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]  # the folders above it too were ours


def test_a_refused_submit_into_a_folder_of_the_users_removes_only_what_it_added(tmp_path, refusing_sbatch):
    run_dir = tmp_path / "mine"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("the user's")
    for _ in range(2):
        error = _refused(run_dir)
        assert "Invalid partition" in str(error), error
        assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]
    assert (run_dir / "notes.txt").read_text() == "the user's"
