"""The srun executor without a cluster: the allocation read from fake SLURM_* variables, the job fitted
to it (defaults taken from it, refusals naming both numbers: exit 2, one line, nothing written), the
exact srun command line, the dry-run plan, `hpc-ddp run`, and what reaches the step through scancel."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from click.testing import CliRunner

from hpc_ddp.cli.app import cli
from hpc_ddp.common.errors import UserError
from hpc_ddp.common.procs import Completed, FakeCommands
from hpc_ddp.launch.executors import NAMES, choose_executor, get_executor
from hpc_ddp.launch.executors.base import Plan, Run
from hpc_ddp.launch.executors.srun import (
    Allocation,
    SrunExecutor,
    _Step,
    allocation_from_env,
    fit_to_allocation,
    output_pattern,
    srun_argv,
)
from hpc_ddp.spec.jobspec import EXECUTORS, JobSpec, Target

# What `salloc -N2 --gpus-per-node=2 --ntasks-per-node=2` exports (Slurm 22.05, the test Slurm).
SALLOC = {
    "SLURM_JOB_ID": "184", "SLURM_JOBID": "184", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "hpcn[1-2]", "SLURM_NODELIST": "hpcn[1-2]", "SLURM_GPUS_PER_NODE": "2",
    "SLURM_JOB_CPUS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
}
OUTSIDE = {k: None for k in ("SLURM_JOB_ID", "SLURM_JOBID")}  # CliRunner's env: None removes a variable


def _spec(**kw) -> JobSpec:
    base = dict(target=Target("script", "/w/train.py", ("--lr", "0.1")), job_name="train", workdir="/w",
                python="/venv/bin/python")
    return JobSpec(**{**base, **kw})


def _alloc(**env) -> Allocation:
    return allocation_from_env({**SALLOC, **env})


# ---- the allocation, from its variables ----

def test_the_allocation_is_read_from_what_salloc_exports():
    alloc = _alloc()
    assert (alloc.job_id, alloc.nodes, alloc.nodelist) == ("184", 2, "hpcn[1-2]")
    assert (alloc.gpus_per_node, alloc.cpus_per_node, alloc.step) == (2, 2, None)
    assert alloc.gpus_per_node_variable


@pytest.mark.parametrize("env, gpus", [
    ({"SLURM_GPUS_PER_NODE": "a100:2,v100:1"}, 3),                       # typed, several kinds
    ({"SLURM_GPUS_PER_NODE": None, "SLURM_JOB_GPUS": "0,1,2,3"}, 4),      # a batch job's GPUs
    ({"SLURM_GPUS_PER_NODE": None, "SLURM_GPUS_ON_NODE": "8"}, 8),        # inside a step
    ({"SLURM_GPUS_PER_NODE": None}, None),                                # salloc --gres=gpu:2 says nothing
])
def test_gpus_per_node_come_from_whichever_variable_says(env, gpus):
    base = {k: v for k, v in {**SALLOC, **env}.items() if v is not None}
    assert allocation_from_env(base).gpus_per_node == gpus


def test_cpus_per_node_are_the_fewest_any_node_has():
    assert _alloc(SLURM_JOB_CPUS_PER_NODE="72(x2),36", SLURM_JOB_NUM_NODES="3").cpus_per_node == 36


@pytest.mark.parametrize("step, own", [("3", "3"), ("4294967290", None), ("4294967291", None), ("", None)])
def test_a_shell_inside_a_regular_step_is_told_from_salloc_and_batch_shells(step, own):
    assert _alloc(SLURM_STEP_ID=step).step == own


def test_outside_an_allocation_is_one_line_with_the_fix():
    with pytest.raises(UserError) as err:
        allocation_from_env({"PATH": "/usr/bin"})
    assert "SLURM_JOB_ID is not set" in err.value.message and "salloc" in err.value.hint
    assert "--executor sbatch" in err.value.hint and "\n" not in str(err.value)


# ---- fitting the job to the allocation ----

def test_sizes_not_given_are_the_allocations():
    fitted = fit_to_allocation(_spec(), _alloc(), given=frozenset())
    assert (fitted.nodes, fitted.gpus, fitted.tasks_per_node) == (2, 2, 2)


def test_sizes_given_are_kept():
    fitted = fit_to_allocation(_spec(nodes=1, gpus=1, tasks_per_node=1), _alloc(),
                               given=frozenset({"nodes", "gpus"}))
    assert (fitted.nodes, fitted.gpus, fitted.tasks_per_node) == (1, 1, 1)


def test_tasks_given_without_gpus_share_the_allocations_gpus():
    fitted = fit_to_allocation(_spec(), _alloc(), given=frozenset({"tasks_per_node"}))
    assert (fitted.gpus, fitted.tasks_per_node) == (2, 1)


@pytest.mark.parametrize("low, high, nodes", [(1, 4, 2), (1, 2, 2), (2, 2, 2), (1, 1, 1)])
def test_a_node_range_runs_on_as_many_of_the_allocations_nodes_as_it_may(low, high, nodes):
    """Issue 32: --nodes MIN-MAX inside an allocation of 2 nodes takes min(2, MAX), the range kept for resumes."""
    spec = _spec(nodes=low, nodes_max=high if high > low else None)
    fitted = fit_to_allocation(spec, _alloc(), given=frozenset({"nodes"}))
    assert fitted.nodes == nodes and fitted.nodes_max == spec.nodes_max


def test_a_range_whose_least_is_more_than_the_allocation_is_refused():
    with pytest.raises(UserError, match=r"--nodes 3-4: allocation \S+ has 2 node"):
        fit_to_allocation(_spec(nodes=3, nodes_max=4), _alloc(), given=frozenset({"nodes"}))


def test_without_a_command_line_the_spec_is_taken_as_it_is():
    assert fit_to_allocation(_spec(), _alloc(), given=None) == _spec()


@pytest.mark.parametrize("spec, words", [
    (_spec(nodes=3), ["--nodes 3", "has 2 node(s)", "salloc -N3"]),
    (_spec(gpus=4, tasks_per_node=4), ["--gpus 4", "2 GPU(s) per node", "SLURM_GPUS_PER_NODE=2"]),
    (_spec(tasks_per_node=2, cpus_per_task=2), ["need 4 CPUs per node", "has 2", "SLURM_JOB_CPUS_PER_NODE=2(x2)"]),
])
def test_a_job_bigger_than_the_allocation_is_refused_naming_both_numbers(spec, words):
    with pytest.raises(UserError) as err:
        fit_to_allocation(spec, _alloc(), given=frozenset({"nodes", "gpus", "tasks_per_node"}))
    assert all(w in str(err.value) for w in words), str(err.value)
    assert err.value.hint and "\n" not in str(err.value)


def test_one_rank_per_gpu_does_not_fit_an_allocation_of_one_cpu_per_node():
    """`salloc -N2 --gpus-per-node=2` alone gives one CPU per node: the fix is named."""
    with pytest.raises(UserError) as err:
        fit_to_allocation(_spec(), _alloc(SLURM_JOB_CPUS_PER_NODE="1(x2)"), given=frozenset())
    assert "2 task(s) per node" in err.value.message and "has 1" in err.value.message
    assert "--ntasks-per-node=2" in err.value.hint


# ---- the srun command line ----

def test_the_srun_command_line():
    spec = _spec(nodes=2, gpus=2, tasks_per_node=2, cpus_per_task=3, mem="8G", time=5400)
    argv = srun_argv(spec, "/w/runs/a", "184-srun-7-9", 1, _alloc(SLURM_JOB_CPUS_PER_NODE="6(x2)"))
    assert argv == [
        "srun", "--job-name=184-srun-7-9", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--cpus-per-task=3",
        "--gpus-per-node=2", "--mem=8G", "--time=0-01:30:00", "--kill-on-bad-exit=1",
        "--output=/w/runs/a/logs/job-184-srun-7-9/attempt-1/rank-%t.log",
        "/venv/bin/python", "-m", "hpc_ddp.job.runner", "/w/runs/a/spec.json"]


def test_every_size_is_explicit_so_salloc_variables_cannot_change_the_step():
    """salloc -n4 exports SLURM_NTASKS=4, which srun reads as -n4: --ntasks always says how many."""
    argv = srun_argv(_spec(nodes=2), "/r", "j", 0, _alloc(SLURM_GPUS_PER_NODE=None))
    assert "--ntasks=2" in argv and "--ntasks-per-node=1" in argv and "--nodes=2" in argv


@pytest.mark.parametrize("spec, env, expected", [
    (_spec(gpus=1), {}, ["--gpus-per-node=1"]),
    (_spec(gpus=1, gpu_request="gres"), {}, ["--gres=gpu:1"]),
    (_spec(), {}, ["--gpus-per-node=0"]),          # no GPUs, though salloc exported SLURM_GPUS_PER_NODE
    (_spec(), {"SLURM_GPUS_PER_NODE": None, "SLURM_JOB_GPUS": "0,1"}, ["--gres=none"]),
    (_spec(), {"SLURM_GPUS_PER_NODE": None}, []),  # the allocation's GPUs are not known: srun's default
])
def test_the_steps_gpu_request(spec, env, expected):
    base = {k: v for k, v in {**SALLOC, **env}.items() if v is not None}
    argv = srun_argv(spec, "/r", "j", 0, allocation_from_env(base))
    assert [a for a in argv if a.startswith(("--gpus", "--gres"))] == expected


def test_a_step_started_from_a_steps_shell_overlaps_it():
    assert "--overlap" in srun_argv(_spec(), "/r", "j", 0, _alloc(SLURM_STEP_ID="0"))
    assert "--overlap" not in srun_argv(_spec(), "/r", "j", 0, _alloc())


def test_a_percent_in_the_run_dir_reaches_srun_as_itself():
    assert output_pattern("/w/100%j", "184-srun-1-2", 0) == "/w/100%%j/logs/job-184-srun-1-2/attempt-0/rank-%t.log"


def test_a_run_dir_with_a_backslash_is_refused():
    with pytest.raises(UserError, match="backslash"):
        SrunExecutor(environ=SALLOC, given=frozenset()).plan(_spec(), "/w/a\\b")


# ---- through the CLI: refusals, defaults, the dry run ----

@pytest.fixture
def ws(tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("print('hi')\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _cli(*args: str, env: dict):
    return CliRunner().invoke(cli, list(args), env=env)


def _error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("hpc-ddp: error:")]


@pytest.mark.parametrize("args, env, words", [
    (["submit", "--executor", "srun"], OUTSIDE, ["SLURM_JOB_ID is not set", "HINT: run `salloc"]),
    (["run"], OUTSIDE, ["SLURM_JOB_ID is not set"]),
    (["submit", "--executor", "srun", "--nodes", "3"], SALLOC, ["--nodes 3", "allocation 184 has 2 node(s)"]),
    (["run", "--gpus", "4"], SALLOC, ["--gpus 4", "has 2 GPU(s) per node"]),
    (["run"], {**SALLOC, "SLURM_JOB_CPUS_PER_NODE": "1(x2)"}, ["need 2 CPUs per node", "has 1"]),
    (["run", "--dry-run", "--nodes", "3"], SALLOC, ["--nodes 3"]),  # a dry run is refused alike
])
def test_bad_input_is_exit_2_one_line_and_nothing_written(ws, args, env, words):
    result = _cli(*args, "--run-dir", "run", "train.py", env=env)
    assert result.exit_code == 2, result.output
    errors = _error_lines(result)
    assert len(errors) == 1 and all(w in errors[0] for w in words), result.stderr
    assert not (ws / "run").exists() and not (ws / "runs").exists()


def test_run_refuses_another_executor(ws):
    result = _cli("run", "--executor", "local", "train.py", env=SALLOC)
    assert result.exit_code == 2 and "always uses --executor srun" in result.stderr


def _dry_run(*args: str, env=None) -> str:
    result = _cli(*args, "--dry-run", "--run-dir", "run", "train.py", "--", "--lr", "0.1", env=env or SALLOC)
    assert result.exit_code == 0, result.output
    return result.stdout


def test_the_dry_run_is_the_srun_command_line_between_the_policys_calls(ws):
    text = _dry_run("submit", "--executor", "srun")
    lines = text.splitlines()
    begin = next(i for i, ln in enumerate(lines) if " -m hpc_ddp.job.attempts begin " in ln)
    step, end = lines[begin + 1], lines[begin + 2]
    words = shlex.split(step)
    assert words[0].startswith("MASTER_PORT=") and words[1] == "HPC_DDP_RESTART_COUNT=0" and words[2] == "srun"
    job_id = words[3].removeprefix("--job-name=")
    run_dir = str(ws / "run")
    assert words[3:] == [f"--job-name={job_id}", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--gpus-per-node=2",
                         "--kill-on-bad-exit=1", f"--output={run_dir}/logs/job-{job_id}/attempt-0/rank-%t.log",
                         sys.executable, "-m", "hpc_ddp.job.runner", f"{run_dir}/spec.json"]
    assert job_id.startswith("184-srun-")
    assert " -m hpc_ddp.job.attempts end " in end and end.endswith('0 "$?"')
    assert f"HPC_DDP_JOB_ID={job_id}" in lines[begin] and "env -u SLURM_JOB_ID" in lines[begin]
    assert "2 node(s) x 2 task(s) = 4 rank(s)" in text and "train.py --lr 0.1" in text
    assert not (ws / "run").exists()  # a dry run writes nothing


def test_run_is_submit_with_the_srun_executor(ws):
    assert _dry_run("run").split("HPC_DDP_JOB_ID=")[0] == _dry_run("submit", "--executor", "srun").split(
        "HPC_DDP_JOB_ID=")[0]


def test_nodes_given_on_the_command_line_are_used_as_given(ws):
    text = _dry_run("run", "--nodes", "1", "--gpus", "1")
    assert "--nodes=1 --ntasks=1 --ntasks-per-node=1 --gpus-per-node=1" in text


def test_settings_the_allocation_decides_are_said_to_be_ignored(ws):
    assert "Ignored (the allocation's own): --partition, --sbatch-arg." in _dry_run(
        "run", "--partition", "gpu", "--sbatch-arg=--exclusive")


# ---- registered like every executor ----

def test_srun_is_an_executor_and_a_spec_value():
    assert "srun" in NAMES and "srun" in EXECUTORS
    executor = get_executor("srun", commands=FakeCommands())
    assert executor.name == "srun" and executor.queues is False
    assert choose_executor("srun", sbatch_found=True) == ("srun", "as requested")
    assert choose_executor(None, sbatch_found=True)[0] == "sbatch"  # never chosen unasked


def test_a_run_that_is_not_running_here_cannot_be_cancelled_or_signalled(tmp_path):
    executor, run = get_executor("srun"), Run(tmp_path, "184-srun-1-2", "srun")
    assert executor.state(run) == {}
    for act in (lambda: executor.cancel(run), lambda: executor.signal(run, "USR2")):
        with pytest.raises(UserError, match="no srun job is running"):
            act()


# ---- submit: a stale allocation, and signals to the step ----

def _squeue(stdout: str, rc: int = 0, stderr: str = ""):
    return FakeCommands({"squeue": lambda argv: Completed(tuple(argv), rc, stdout, stderr)})


@pytest.mark.parametrize("fake, words", [
    (_squeue("", 1, "slurm_load_jobs error: Invalid job id specified"), "has ended"),
    (_squeue("COMPLETED|2026-11-22T07:00:00\n"), "is COMPLETED, not running"),
])
def test_an_allocation_that_is_not_running_is_refused_before_anything_is_written(tmp_path, fake, words):
    executor = SrunExecutor(fake, environ=SALLOC, given=frozenset())
    plan = Plan("srun", _spec(), str(tmp_path / "run"), None, "")
    with pytest.raises(UserError, match=words):
        executor.submit(plan)
    assert not (tmp_path / "run").exists()


def test_without_srun_on_path_nothing_is_written(tmp_path):
    fake = FakeCommands({"squeue": lambda argv: Completed(tuple(argv), 0, "RUNNING|2026-11-22T07:00:00\n")},
                        installed=("squeue", "scancel"))
    plan = Plan("srun", _spec(), str(tmp_path / "run"), None, "")
    with pytest.raises(UserError, match="srun is not on PATH"):
        SrunExecutor(fake, environ=SALLOC, given=frozenset()).submit(plan)
    assert not (tmp_path / "run").exists()


def test_signals_reach_the_step_through_scancel_once_its_id_is_known():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        fake = FakeCommands({
            "squeue": lambda argv: Completed(tuple(argv), 0, "184.0|other\n184.3|184-srun-7-9\n"),
            "scancel": lambda argv: Completed(tuple(argv), 0)})
        step = _Step(sleeper, "184", "184-srun-7-9", fake)
        step.pending += ["TERM", "USR2"]
        step.find_id()
        step.deliver()
    finally:
        sleeper.kill()
        sleeper.wait()
    assert step.id == "184.3" and step.pending == []
    assert [c[0] for c in fake.calls] == [
        ("squeue", "--noheader", "--steps", "--jobs=184", "--format=%i|%j"),
        ("scancel", "--signal=TERM", "184.3"), ("scancel", "--signal=USR2", "184.3")]


def test_signals_wait_for_the_step_id_while_the_step_is_being_made():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        fake = FakeCommands({"squeue": lambda argv: Completed(tuple(argv), 0, "")})
        step = _Step(sleeper, "184", "184-srun-7-9", fake)
        step.pending.append("TERM")
        step.find_id()
        step.deliver()
        assert step.pending == ["TERM"] and sleeper.poll() is None  # srun is not killed meanwhile
    finally:
        sleeper.kill()
        sleeper.wait()
