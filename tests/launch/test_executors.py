"""Every executor does the whole job behind one protocol (plan, submit, state, cancel, signal), and no
command switches on an executor's name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hpc_ddp.cli as cli_package
from hpc_ddp.common.errors import UserError
from hpc_ddp.common.procs import Completed, FakeCommands
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.launch.executors import NAMES, executor_for_run, get_executor
from hpc_ddp.launch.executors.base import Run

PROTOCOL = ("plan", "submit", "state", "cancel", "signal")


@pytest.mark.parametrize("name", NAMES)
def test_every_executor_has_the_whole_protocol(name):
    executor = get_executor(name, commands=FakeCommands())
    assert executor.name == name and isinstance(executor.queues, bool)
    assert all(callable(getattr(executor, method)) for method in PROTOCOL)


def test_only_executors_whose_jobs_queue_are_checked_against_the_cluster():
    assert {n: get_executor(n).queues for n in NAMES} == {"sbatch": True, "submitit": True, "local": False,
                                                             "srun": False}


def test_a_run_without_a_recorded_executor_is_managed_as_an_sbatch_one():
    assert executor_for_run(None).name == "sbatch"


def _slurm(tmp_path: Path, answers: dict[str, tuple[int, str, str]]):
    fake = FakeCommands({cmd: (lambda argv, a=a: Completed(tuple(argv), *a)) for cmd, a in answers.items()})
    return get_executor("sbatch", commands=fake), fake, Run(tmp_path, "41", "sbatch")


def test_slurm_jobs_are_cancelled_with_scancel_and_the_cancel_is_recorded(tmp_path):
    executor, fake, run = _slurm(tmp_path, {"scancel": (0, "", "")})
    assert executor.cancel(run) == f"Cancelled job 41 ({tmp_path})"
    assert fake.calls[-1][0] == ("scancel", "41")
    assert '"event": "cancelled"' in RunDir(tmp_path).events.read_text()


def test_slurm_jobs_are_signalled_with_scancel_signal(tmp_path):
    executor, fake, run = _slurm(tmp_path, {"scancel": (0, "", "")})
    executor.signal(run, "USR2")
    assert fake.calls[-1][0] == ("scancel", "--signal", "USR2", "41")


def test_a_refused_scancel_is_one_line_for_the_user(tmp_path):
    executor, _, run = _slurm(tmp_path, {"scancel": (1, "", "scancel: error: Invalid job id specified")})
    with pytest.raises(UserError, match="Invalid job id"):
        executor.cancel(run)
    assert not RunDir(tmp_path).events.exists()  # nothing recorded for a cancel that did not happen


def test_slurm_state_comes_from_squeue(tmp_path):
    executor, _, run = _slurm(tmp_path, {"squeue": (0, "RUNNING|None\n", ""), "sacct": (1, "", "disabled")})
    assert executor.state(run) == {"state": "RUNNING", "reason": None, "source": "squeue"}
    assert executor.state(Run(tmp_path, None, "sbatch")) == {}  # never submitted: nothing to ask


def test_a_local_run_that_is_not_running_cannot_be_cancelled_or_signalled(tmp_path):
    local, run = get_executor("local"), Run(tmp_path, "local-1-2", "local")
    assert local.state(run) == {}
    for act in (lambda: local.cancel(run), lambda: local.signal(run, "USR2")):
        with pytest.raises(UserError, match="no local job is running"):
            act()


def test_no_command_branches_on_an_executor_name():
    cli_dir = Path(cli_package.__file__).parent
    names = "|".join(NAMES)
    branch = re.compile(rf"""(==|!=|\bin\b)\s*\(?["']({names})["']|["']({names})["']\s*(==|!=)""")
    offenders = [f"{p.name}:{n}: {line.strip()}" for p in sorted(cli_dir.glob("*.py"))
                 for n, line in enumerate(p.read_text().splitlines(), 1) if branch.search(line)]
    assert offenders == []


def test_cancelling_a_run_also_cancels_its_later_jobs_still_queued(tmp_path):
    """A chain of 3 (41, 42, 43) and a job the requeue fallback queued (44): 41 runs, 42 and 44 wait,
    43 has ended. Cancelling the run must not leave 42 or 44 to start later."""
    RunDir(tmp_path).submissions.write_text("".join(
        f'{{"executor": "sbatch", "job_id": "{j}", "run_dir": "{tmp_path}"}}\n' for j in ("41", "42", "43", "44")))
    executor, fake, run = _slurm(tmp_path, {"scancel": (0, "", ""), "squeue": (0, "42\n44\n", "")})
    assert executor.cancel(run) == f"Cancelled job 41 and its queued job(s) 42, 44 ({tmp_path})"
    assert fake.calls[-2][0] == ("squeue", "-h", "-o", "%i", "-j", "42,43,44")
    assert fake.calls[-1][0] == ("scancel", "41", "42", "44")
    events = RunDir(tmp_path).events.read_text()
    assert all(f'"job_id": "{j}"' in events for j in ("41", "42", "44")) and '"43"' not in events


def test_the_local_executors_node_scratch_is_private_and_gone_after_the_job(tmp_path, monkeypatch):
    """/tmp/hpc-ddp-local-<hash>/node-<k>: made 0700, someone else's (or a link) refused, removed at the
    job's end when this job made it."""
    import os
    import stat

    from hpc_ddp.common.errors import EnvError
    from hpc_ddp.launch.executors import local

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    run_dir = str(tmp_path / "run")
    node = local.node_scratch(run_dir, 0)
    local._own_scratch(node)
    assert stat.S_IMODE(node.stat().st_mode) == 0o700 and stat.S_IMODE(node.parent.stat().st_mode) == 0o700
    other = local.node_scratch(str(tmp_path / "other"), 0)
    other.parent.parent.mkdir(exist_ok=True)
    other.parent.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(EnvError, match="is not a folder of yours"):
        local._own_scratch(other)
    assert os.listdir(tmp_path / "elsewhere") == []
