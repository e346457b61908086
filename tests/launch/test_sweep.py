"""Sweeps on the login node: the array script (golden, bash -n, injection), one array with each task recorded
by its own id, the sequential fallback, resubmission, and the table `status` prints."""

import json
import subprocess
from pathlib import Path

import pytest

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.procs import Completed, FakeCommands
from hpc_ddp.common.rundir import RunDir, is_sweep_dir
from hpc_ddp.launch.executors import get_executor
from hpc_ddp.launch.sweep import (
    best_metric,
    cancel_sweep,
    check_array_size,
    check_resubmission,
    format_sweep,
    in_state,
    plan_sweep,
    read_sweep,
    signal_sweep,
    submit_sweep,
    sweep_status,
    task_runs,
)
from hpc_ddp.spec.jobspec import Layer, Target, build_spec
from hpc_ddp.spec.sweep import sweep_from, task_spec
from tests.launch.test_render import bash_n, check_golden

TARGET = Target("script", "/home/ada/proj/train.py", ("--steps", "100"))


def _builder(values: dict):
    def build(extra):
        return build_spec([Layer("command line", values), *extra], target=TARGET, workdir="/home/ada/proj",
                          python="/opt/venv/bin/python")
    return build


def _plan(executor, sweep_dir: str, flags=("lr=0.1,0.01", "args.dropout=0.1,0.3"), max_running=None,
          values=None):
    build = _builder(values or {"nodes": 2, "gpus": 4, "time": "1:00:00", "partition": "gpu"})
    sweep = sweep_from(list(flags), None, max_running, "script")
    base = build([])
    return plan_sweep(executor, sweep, sweep_dir, lambda v, i: task_spec(base, v, i, build))


def _sbatch(answer="4711"):
    fake = FakeCommands({"sbatch": lambda argv: Completed(tuple(argv), 0, f"{answer}\n"),
                         "scancel": lambda argv: Completed(tuple(argv), 0)})
    return get_executor("sbatch", commands=fake, generated_at="2026-01-02T03:04:05",
                        command_line="hpc-ddp submit --sweep lr=0.1,0.01 --sweep args.dropout=0.1,0.3 train.py"), fake


def test_golden_array_script():
    executor, _ = _sbatch()
    plan = _plan(executor, "/scratch/ada/runs/train-1", max_running=2)
    bash_n(plan.script)
    check_golden("sweep_array.sbatch", plan.script)
    assert "#SBATCH --array=0-3%2" in plan.script and "#SBATCH --output=task-%a/logs/slurm-%A_%a.out" in plan.script
    assert plan.tasks[3].plan.spec.target.args == ("--steps", "100", "--dropout=0.3")
    assert "--dropout=0.3" in plan.tasks[3].plan.script  # each task's own job script carries its values


def test_the_array_script_runs_the_task_its_index_names(tmp_path):
    """Run the array script's body for real, with a stub task script in each task dir."""
    executor, _ = _sbatch()
    plan = _plan(executor, str(tmp_path / "sweep; rm -rf ~"))  # a hostile dir name is only ever quoted
    for task in plan.tasks:
        Path(task.run_dir).mkdir(parents=True)
        RunDir(task.run_dir).script.write_text(f"echo ran task {task.index} in \"$PWD\"\n")
    for index in (0, 3):
        done = subprocess.run(["bash", "-c", plan.script], env={"SLURM_ARRAY_TASK_ID": str(index), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0 and done.stdout.startswith(f"ran task {index}"), done.stderr
    done = subprocess.run(["bash", "-c", plan.script], env={"SLURM_ARRAY_TASK_ID": "7"}, capture_output=True, text=True)
    assert done.returncode == 3 and "not a task of this sweep" in done.stderr


def test_one_array_each_task_in_its_own_run_dir_recorded_by_its_own_id(tmp_path):
    executor, fake = _sbatch("4711;cluster")
    plan = _plan(executor, str(tmp_path / "sweep"))
    seen = []
    subs = submit_sweep(executor, plan, lambda task, job: seen.append((task.index, job)))
    assert [s.job_id for s in subs] == ["4711_0", "4711_1", "4711_2", "4711_3"] and [i for i, _ in seen] == [0, 1, 2, 3]
    (call,) = [c for c in fake.calls if c[0][0] == "sbatch"]
    assert call[0] == ("sbatch", "--parsable", "job.sbatch") and call[1] == str(tmp_path / "sweep")
    for task in plan.tasks:
        paths = RunDir(task.run_dir)
        assert paths.spec.is_file() and paths.script.is_file() and paths.logs.is_dir()
        assert paths.job_ids() == [f"4711_{task.index}"]
    record = read_sweep(tmp_path / "sweep")
    assert is_sweep_dir(tmp_path / "sweep") and record["array_job_id"] == "4711"
    assert [t["run_dir"] for t in record["tasks"]] == ["task-0", "task-1", "task-2", "task-3"]
    assert record["tasks"][2]["values"] == {"lr": 0.01, "args.dropout": "0.1"}  # the script's text, as given


def test_a_bad_dependency_writes_nothing(tmp_path):
    fake = FakeCommands({"scontrol": lambda argv: Completed(tuple(argv), 1, "", "Invalid job id specified"),
                         "sacct": lambda argv: Completed(tuple(argv), 0, "")})
    executor = get_executor("sbatch", commands=fake)
    plan = _plan(executor, str(tmp_path / "sweep"), values={"nodes": 2, "after": "99"})
    with pytest.raises(UserError, match="knows no job 99"):
        submit_sweep(executor, plan, lambda task, job: None)
    assert not any(c[0][0] == "sbatch" for c in fake.calls)
    assert not any((tmp_path / "sweep").glob("task-*")) and not (tmp_path / "sweep" / "sweep.json").exists()


def test_the_same_sweep_may_be_submitted_again_to_resume_another_may_not(tmp_path):
    executor, _ = _sbatch()
    submit_sweep(executor, _plan(executor, str(tmp_path / "s")), lambda t, j: None)
    check_resubmission(_plan(executor, str(tmp_path / "s")))  # the same sweep: resumes each task
    with pytest.raises(UserError, match="holds another sweep"):
        check_resubmission(_plan(executor, str(tmp_path / "s"), flags=("lr=0.5,0.6",)))


def test_a_task_dir_that_is_not_ours_is_not_written_into(tmp_path):
    executor, _ = _sbatch()
    (tmp_path / "s" / "task-1").mkdir(parents=True)
    (tmp_path / "s" / "task-1" / "thesis.tex").write_text("mine")
    with pytest.raises(UserError, match="not a run dir hpc-ddp made"):
        check_resubmission(_plan(executor, str(tmp_path / "s")))
    assert (tmp_path / "s" / "task-1" / "thesis.tex").read_text() == "mine"


def test_executors_without_arrays_get_the_tasks_one_by_one_each_with_its_own_id(tmp_path, monkeypatch):
    local = get_executor("local", job_id="local-1")
    ran = []

    def fake_submit(self, plan, on_job_id=None):
        from hpc_ddp.launch.executors.base import Submission
        on_job_id(self.job_id)
        ran.append((self.job_id, plan.run_dir))
        return Submission("local", self.job_id, plan.run_dir, None, state="CANCELLED" if len(ran) == 2 else "COMPLETED")
    monkeypatch.setattr(type(local), "submit", fake_submit)
    plan = _plan(local, str(tmp_path / "s"), values={"nodes": 1})
    assert plan.script is None and "task 3" in plan.dry_run_text()
    subs = submit_sweep(local, plan, lambda t, j: None)
    assert ran == [("local-1-t0", str(tmp_path / "s" / "task-0")), ("local-1-t1", str(tmp_path / "s" / "task-1"))]
    assert len(subs) == 2  # a cancelled task stops the sweep: Ctrl-C means stop, not skip to the next


def test_max_running_needs_an_array():
    with pytest.raises(Exception, match="one by one|one after another"):
        _plan(get_executor("local"), "/tmp/x", max_running=2, values={"nodes": 1})


def test_max_array_size_is_the_clusters():
    check_array_size(1001, {"MaxArraySize": "1001"})
    check_array_size(5000, None)  # unknown: sbatch will say
    with pytest.raises(UserError, match="MaxArraySize of 1001"):
        check_array_size(1002, {"MaxArraySize": "1001"})


def test_best_metric_defaults_and_named():
    metrics = [{"step": 1, "loss": 2.0, "eval_acc": 0.1}, {"step": 2, "loss": 1.5}, {"step": 3, "eval_acc": 0.3},
               {"step": 4, "loss": 1.7, "eval_acc": True}]
    assert best_metric(metrics, None) == {"name": "eval_acc", "mode": "max", "value": 0.3, "step": 3}
    assert best_metric(metrics, "loss:min") == {"name": "loss", "mode": "min", "value": 1.5, "step": 2}
    assert best_metric([], None) is None


def test_status_table(tmp_path):
    executor, _ = _sbatch()
    plan = _plan(executor, str(tmp_path / "s"))
    submit_sweep(executor, plan, lambda t, j: None)
    (Path(plan.tasks[2].run_dir) / "metrics.jsonl").write_text(json.dumps({"step": 9, "eval_acc": 0.75}) + "\n")
    states = {"4711_0": "COMPLETED", "4711_1": "RUNNING", "4711_2": "RUNNING", "4711_3": "PENDING"}

    def task_status(run_dir, job_id, executor_name):
        assert executor_name == "sbatch"
        return {"state": states[job_id], "step": 9 if job_id == "4711_2" else None, "total_steps": 20,
                "restarts": 1 if job_id == "4711_2" else 0}
    info = sweep_status(tmp_path / "s", task_status)
    lines = list(format_sweep(info))
    assert lines[0].startswith(f"sweep {tmp_path / 's'}  (array job 4711; 4 tasks: 1 COMPLETED, 1 PENDING, 2 RUNNING)")
    assert lines[1].split() == ["task", "values", "state", "step", "best", "job"]
    assert lines[4].split() == ["2", "lr=0.01", "args.dropout=0.1", "RUNNING", "(1", "restarts)", "9/20",
                                "eval_acc", "0.75", "4711_2"]
    assert lines[-1] == "best so far: task 2 (lr=0.01 args.dropout=0.1): eval_acc 0.75 at step 9"


def test_cancelling_a_sweep_cancels_every_queued_job_of_its_tasks_in_one_scancel(tmp_path):
    """Whichever array queued them: a sweep resubmitted to resume has jobs of two arrays, and a task may have
    a job the requeue fallback queued."""
    executor, fake = _sbatch()
    submit_sweep(executor, _plan(executor, str(tmp_path / "s")), lambda t, j: None)
    with open(RunDir(tmp_path / "s" / "task-2").submissions, "a") as fh:  # the fallback queued job 4800
        fh.write(json.dumps({"executor": "sbatch", "job_id": "4800", "run_dir": str(tmp_path / "s" / "task-2")}) + "\n")
    fake.handlers["squeue"] = lambda argv: Completed(tuple(argv), 0, "4711_1\n4711_3\n4800\n")
    lines = cancel_sweep(tmp_path / "s", executor, live=lambda run: True)
    assert lines == ["Cancelled job(s) 4711_1, 4800, 4711_3"]  # in task order
    assert fake.calls[-2][0] == ("squeue", "-h", "-o", "%i", "-j", "4711_0,4711_1,4711_2,4800,4711_3")
    assert fake.calls[-1][0] == ("scancel", "4711_1", "4800", "4711_3")
    events = {i: RunDir(tmp_path / "s" / f"task-{i}").events for i in range(4)}
    assert not events[0].exists() and '"4711_1"' in events[1].read_text() and '"4800"' in events[2].read_text()
    fake.handlers["squeue"] = lambda argv: Completed(tuple(argv), 0, "")
    with pytest.raises(UserError, match="no job of sweep"):
        cancel_sweep(tmp_path / "s", executor, live=lambda run: True)


def test_a_sweep_with_jobs_still_queued_is_not_submitted_again(tmp_path):
    executor, fake = _sbatch()
    submit_sweep(executor, _plan(executor, str(tmp_path / "s")), lambda t, j: None)
    fake.handlers["squeue"] = lambda argv: Completed(tuple(argv), 0, "4711_2\n")
    with pytest.raises(UserError, match="4711_2 of this sweep are still queued"):
        check_resubmission(_plan(executor, str(tmp_path / "s")), executor)
    fake.handlers["squeue"] = lambda argv: Completed(tuple(argv), 0, "")
    check_resubmission(_plan(executor, str(tmp_path / "s")), executor)


def test_cancelling_a_sweep_without_an_array_cancels_each_live_task(tmp_path):
    class Recorder:
        name = "local"

        def __init__(self):
            self.cancelled = []

        def cancel(self, run):
            self.cancelled.append(run.job_id)
            return f"cancelled {run.job_id}"
    plan = _plan(get_executor("local", job_id="l"), str(tmp_path / "s"), values={"nodes": 1})
    from hpc_ddp.launch.executors.base import Submission, record_submission, write_run_dir
    from hpc_ddp.launch.sweep import _write_sweep
    _write_sweep(plan, None)
    for task in plan.tasks:
        write_run_dir(task.plan)
        record_submission(Submission("local", f"l-t{task.index}", task.run_dir, None, state="RUNNING"))
    recorder = Recorder()
    assert cancel_sweep(tmp_path / "s", recorder, live=lambda run: run.job_id == "l-t2") == ["cancelled l-t2"]
    with pytest.raises(UserError, match="no task of sweep"):
        cancel_sweep(tmp_path / "s", recorder, live=lambda run: False)


def test_preempting_a_sweep_signals_its_running_tasks_in_one_scancel_and_leaves_waiting_ones(tmp_path):
    executor, fake = _sbatch()
    submit_sweep(executor, _plan(executor, str(tmp_path / "s")), lambda t, j: None)
    running = {"4711_1", "4711_2"}
    assert signal_sweep(tmp_path / "s", executor, "USR2", lambda run: run.job_id in running) == \
        "Sent SIGUSR2 to every rank of task(s) 4711_1, 4711_2"
    assert fake.calls[-1][0] == ("scancel", "--signal", "USR2", "4711_1", "4711_2")
    with pytest.raises(UserError, match="no task of sweep .* is running"):
        signal_sweep(tmp_path / "s", executor, "USR2", lambda run: False)
    # a TERM rehearsal is recorded in each running task's run dir first (Slurm knows nothing of it)
    from hpc_ddp.common.events import read_jsonl
    from hpc_ddp.launch.sweep import task_runs

    signal_sweep(tmp_path / "s", executor, "TERM", lambda run: run.job_id == "4711_1")
    marked = {run.job_id: [e.get("signal") for e in read_jsonl(run.paths.events) if e.get("event") ==
                           "preempt_rehearsed"] for run in task_runs(tmp_path / "s")}
    assert marked["4711_1"] == ["TERM"] and all(v == [] for k, v in marked.items() if k != "4711_1"), marked


def test_task_states_come_from_one_question_for_the_whole_array(tmp_path):
    fake = FakeCommands({"sbatch": lambda argv: Completed(tuple(argv), 0, "4711\n"),
                         "sacct": lambda argv: Completed(tuple(argv), 0, ""),
                         "squeue": lambda argv: Completed(tuple(argv), 0, "4711_0|RUNNING|None\n4711_3|PENDING|"
                                                                         "JobArrayTaskLimit\n")},
                        installed=("sbatch", "squeue", "sacct", "scancel"))
    executor = get_executor("sbatch", commands=fake)
    submit_sweep(executor, _plan(executor, str(tmp_path / "s")), lambda t, j: None)
    running = in_state(tmp_path / "s", executor, fake, ("RUNNING",))
    assert [run.job_id for run in task_runs(tmp_path / "s") if running(run)] == ["4711_0"]
    asked = [c[0][0] for c in fake.calls if c[0][0] in ("squeue", "sacct")]
    assert asked == ["sacct", "squeue"]  # once each, not once per task


def test_a_hand_edited_sweep_json_cannot_point_outside_the_sweep_or_crash_status(tmp_path):
    sweep = tmp_path / "s"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({
        "array_job_id": "7; rm -rf ~", "metric": "acc", "executor": "sbatch",
        "tasks": [{"index": 0, "values": {"lr": 1}, "run_dir": "../../victim"}, "abc",
                  {"index": 1, "values": {"lr": 2}, "run_dir": "task-1"}]}))
    data = read_sweep(sweep)
    assert data["array_job_id"] is None and data["metric"] is None
    assert [t["run_dir"] for t in data["tasks"]] == ["task-1"]
    info = sweep_status(sweep, lambda *a: pytest.fail("task-1 was never submitted"))
    assert [r["state"] for r in info["tasks"]] == ["NOT SUBMITTED"]
