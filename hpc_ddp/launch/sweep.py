"""Sweeps on the login node: plan one (every task's spec and run dir, and where the executor runs arrays,
the one array script), submit it, and read it back as a table for `status` and `list`.

A task is a whole job: its run dir (SWEEP_DIR/task-<i>/) holds its spec, batch script, requeue policy,
checkpoints and logs, exactly as a single run's. The sbatch executor queues all tasks as one Slurm array
whose script only picks the task's own job script (`templates/sweep.sh.j2`); Slurm gives every task its
own job id (so its own derived port) and requeues a task by its own id (<array>_<task>). The executors
that run jobs here or queue them one by one (local, srun, submitit) get the tasks one after another.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.common import rundir
from hpc_ddp.common.durable import write_file
from hpc_ddp.common.errors import SpecError, UserError
from hpc_ddp.common.events import read_jsonl
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.launch.executors.base import Plan, Run, Submission
from hpc_ddp.launch.shellwords import bash_word
from hpc_ddp.slurm.jobstate import array_states
from hpc_ddp.spec.jobspec import JobSpec
from hpc_ddp.spec.sweep import Sweep, describe

__all__ = ["Task", "SweepPlan", "plan_sweep", "submit_sweep", "read_sweep", "sweep_status", "format_sweep",
           "array_directives", "check_array_size", "best_metric", "task_runs", "cancel_sweep",
           "signal_sweep", "in_state", "first_task_spec"]


@dataclasses.dataclass(frozen=True)
class Task:
    index: int
    values: Mapping[str, Any]
    plan: Plan

    @property
    def run_dir(self) -> str:
        return self.plan.run_dir


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    executor: str
    sweep: Sweep
    sweep_dir: str
    tasks: tuple[Task, ...]
    script: str | None      # the array's batch script, where the executor queues arrays

    def dry_run_text(self) -> str:
        head = f"# hpc-ddp sweep: {len(self.tasks)} task(s) in {self.sweep_dir}\n"
        if self.script is not None:
            first = self.tasks[0].plan
            return (f"{head}{self.script}\n# ---- task 0's job script, {first.run_dir}/{rundir.SCRIPT} (the other tasks' "
                    f"differ in their values and run dir) ----\n{first.dry_run_text()}")
        return head + "".join(f"\n# ---- task {t.index}: {describe(t.values)} ----\n{t.plan.dry_run_text()}"
                              for t in self.tasks)

    def record(self, array_job: str | None = None) -> dict[str, Any]:
        """sweep.json: what `status` reads back (task dirs are relative: the sweep dir may move)."""
        return {**self.sweep.to_dict(), "executor": self.executor, "array_job_id": array_job,
                "tasks": [{"index": t.index, "values": dict(t.values),
                           "run_dir": Path(t.run_dir).name} for t in self.tasks]}


def plan_sweep(executor, sweep: Sweep, sweep_dir: str,
               task_spec: Callable[[Mapping[str, Any], int], JobSpec]) -> SweepPlan:
    """Pure but for `task_spec` (which builds and checks task i's spec) and the executor's plans. An
    executor that queues arrays (`arrays`) plans the array script too (`plan_array`)."""
    tasks = []
    for index, values in enumerate(sweep.tasks()):
        spec = task_spec(values, index)
        run_dir = str(rundir.task_dir(sweep_dir, index))
        tasks.append(Task(index, values, _for_task(executor, index).plan(spec, run_dir)))
    script = None
    if getattr(executor, "arrays", False):
        script = executor.plan_array(tasks, sweep.max_running)
    elif sweep.max_running is not None:
        raise SpecError(f"--max-running: the {executor.name} executor runs no Slurm arrays; it starts the tasks "
                        "one by one",
                        hint="drop --max-running, or use --executor sbatch (a Slurm array)")
    return SweepPlan(executor.name, sweep, sweep_dir, tuple(tasks), script)


def _for_task(executor, index: int):
    """An executor whose own job ids are per run (local, srun) gives each task its own."""
    for_task = getattr(executor, "for_task", None)
    return for_task(index) if for_task else executor


def array_directives(spec: JobSpec, size: int, max_running: int | None) -> list[str]:
    """Task 0's directives (every task asks for the same allocation), with the array's own output path and
    --array: each task writes into its own run dir."""
    from hpc_ddp.launch.render import directives

    out = [f"--output={rundir.ARRAY_OUTPUT}" if d.startswith("--output=") else d for d in directives(spec)]
    return out + [f"--array=0-{size - 1}" + (f"%{max_running}" if max_running else "")]


def check_array_size(size: int, config: Mapping[str, str] | None) -> None:
    """Slurm refuses an array index >= MaxArraySize; say so before anything is written."""
    raw = (config or {}).get("MaxArraySize", "")
    if raw.isdigit() and size > int(raw):
        raise UserError(f"the sweep has {size} tasks, more than this cluster's MaxArraySize of {raw} allows "
                        f"(indices 0..{int(raw) - 1})", hint="sweep fewer values, or split the sweep in two")


# ---- submit ----

def submit_sweep(executor, plan: SweepPlan, on_job_id: Callable[[Task, str], None]) -> list[Submission]:
    """One array (executors with `submit_array`), else every task in turn. An array's sweep.json is written
    once it is queued (a refused dependency or sbatch leaves no sweep behind); a sweep run task by task
    writes it first, so one interrupted half-way is still a sweep `status` can show."""
    submit_array = getattr(executor, "submit_array", None)
    if submit_array is not None and plan.script is not None:
        subs = submit_array(plan, on_job_id)
        _write_sweep(plan, subs[0].job_id.partition("_")[0])
        return subs
    _write_sweep(plan, None)
    subs = []
    for task in plan.tasks:
        sub = _for_task(executor, task.index).submit(task.plan, on_job_id=lambda job, t=task: on_job_id(t, job))
        subs.append(sub)
        if sub.state == "CANCELLED":  # Ctrl-C (or `hpc-ddp cancel`) stops the sweep, not only this task
            break
    return subs


def check_resubmission(plan: SweepPlan, executor=None) -> None:
    """A sweep submitted again to the same --run-dir resumes its tasks: only the same sweep (task i with
    the same values), and only once none of its jobs is still queued (two jobs in one run dir would write
    the same checkpoints)."""
    old = read_sweep(Path(plan.sweep_dir))
    if old and [t.get("values") for t in old.get("tasks", [])] != [dict(t.values) for t in plan.tasks]:
        raise UserError(f"{plan.sweep_dir} holds another sweep (its task dirs hold other values, or the same in "
                        "another order); its run dirs are not replaced",
                        hint="give a new --run-dir, or the same --sweep values in the same order to resume it")
    taken = [t.run_dir for t in plan.tasks if Path(t.run_dir).exists() and not RunDir(t.run_dir).spec.is_file()]
    if taken:
        raise UserError(f"{taken[0]} exists and is not a run dir hpc-ddp made", hint="give a new --run-dir")
    queued = _queued_jobs(Path(plan.sweep_dir), executor) if old and executor is not None else []
    if queued:
        raise UserError(f"{plan.sweep_dir}: job(s) {', '.join(queued[:4])} of this sweep are still queued or running",
                        hint=f"wait for them, or `hpc-ddp cancel {bash_word(str(plan.sweep_dir))}` first")


def _queued_jobs(sweep_dir: Path, executor) -> list[str]:
    """Every Slurm job recorded in the sweep's task dirs (any array it was submitted as, a requeue
    fallback's jobs) that squeue still lists."""
    still = getattr(executor, "still_queued", None)
    if still is None:
        return []
    jobs = [job for run in task_runs(sweep_dir) for job in run.paths.job_ids()]
    return still(list(dict.fromkeys(jobs)))


def _write_sweep(plan: SweepPlan, array_job: str | None) -> None:
    path = Path(plan.sweep_dir) / rundir.SWEEP
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_file(path, json.dumps(plan.record(array_job), indent=2) + "\n")  # a link planted there is replaced


def read_sweep(sweep_dir: Path) -> dict[str, Any]:
    """sweep.json, with what does not have the shape hpc-ddp writes left out: a task's run dir must be one of
    the sweep's own task-<i> names (never a path out of it), the array id digits, the metric NAME:max|min."""
    try:
        data = json.loads((Path(sweep_dir) / rundir.SWEEP).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    tasks = data.get("tasks") if isinstance(data.get("tasks"), list) else []
    data["tasks"] = [t for t in tasks if isinstance(t, dict) and isinstance(t.get("values"), dict)
                     and isinstance(t.get("index"), int) and t.get("run_dir") == rundir.TASK_DIR.format(index=t["index"])]
    if not re.fullmatch(r"\d+", str(data.get("array_job_id"))):
        data["array_job_id"] = None
    metric = data.get("metric")
    if not (isinstance(metric, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*:(max|min)", metric)):
        data["metric"] = None
    return data


def task_runs(sweep_dir: Path) -> list[Run]:
    """Every submitted task as a Run (its run dir, its last job id, its executor)."""
    runs = []
    for task in read_sweep(sweep_dir).get("tasks", []):
        run_dir = Path(sweep_dir) / str(task.get("run_dir"))
        subs = read_jsonl(RunDir(run_dir).submissions)
        if subs:
            runs.append(Run(run_dir, subs[-1].get("job_id"), subs[-1].get("executor")))
    return runs


def in_state(sweep_dir: Path, executor, commands, states: Sequence[str]) -> Callable[[Run], bool]:
    """Whether a task's scheduler state is one of `states`; for an array, from one question to Slurm."""
    array = read_sweep(sweep_dir).get("array_job_id")
    if array and executor.queues:
        known = array_states(str(array), commands)
        return lambda run: known.get(str(run.job_id), {}).get("state") in states
    return lambda run: executor.state(run).get("state") in states


def signal_sweep(sweep_dir: Path, executor, name: str, running: Callable[[Run], bool]) -> str:
    """The signal to every rank of every running task: in one scancel where the executor can
    (`signal_jobs`), else task by task. Tasks still waiting are left alone: they have nothing to save."""
    runs = [run for run in task_runs(sweep_dir) if running(run)]
    if not runs:
        raise UserError(f"no task of sweep {sweep_dir} is running", hint="`hpc-ddp status` shows the sweep")
    if name == "TERM" and not getattr(executor, "ranks_here", False):
        from hpc_ddp.job.attempts import record_rehearsal

        for run in runs:  # as for one run (cli preempt): each task's attempt ends preempted however it leaves
            record_rehearsal(run.run_dir, name)
    if hasattr(executor, "signal_jobs"):
        executor.signal_jobs([str(run.job_id) for run in runs], name)
    else:
        for run in runs:
            executor.signal(run, name)
    return f"Sent SIG{name} to every rank of task(s) {', '.join(str(r.job_id) for r in runs)}"


def first_task_spec(sweep_dir: Path) -> Path:
    """Task 0's spec.json: every task shares the settings a command may need (its warning signal)."""
    tasks = read_sweep(sweep_dir).get("tasks") or [{}]
    return RunDir(Path(sweep_dir) / str(tasks[0].get("run_dir"))).spec


def cancel_sweep(sweep_dir: Path, executor, live: Callable[[Run], bool]) -> list[str]:
    """Stop every task still queued or running (`live`): an array in one scancel, else task by task
    (a local sweep runs one task at a time; cancelling it stops the sweep's loop too)."""
    if hasattr(executor, "cancel_jobs"):  # every job of every task still queued, whichever array it came from
        queued = _queued_jobs(Path(sweep_dir), executor)
        if not queued:
            raise UserError(f"no job of sweep {sweep_dir} is queued or running", hint="`hpc-ddp status` shows it")
        return [executor.cancel_jobs(queued, task_runs(sweep_dir))]
    runs = [run for run in task_runs(sweep_dir) if live(run)]
    if not runs:
        raise UserError(f"no task of sweep {sweep_dir} is queued or running", hint="`hpc-ddp status` shows the sweep")
    return [executor.cancel(run) for run in runs]


# ---- status ----

# Metrics a task's "best" is read from when the sweep names none: the first one its records hold.
_DEFAULT_METRICS = (("eval_acc", "max"), ("val_acc", "max"), ("accuracy", "max"), ("eval_loss", "min"),
                    ("val_loss", "min"), ("loss", "min"))


def best_metric(metrics: Sequence[Mapping[str, Any]], wanted: str | None) -> dict[str, Any] | None:
    """{'name', 'mode', 'value', 'step'} of the best record of the named metric (NAME:max|min)."""
    choices = [tuple(wanted.split(":"))] if wanted else _DEFAULT_METRICS
    for name, mode in choices:
        # a number that compares: NaN (a diverged run's loss) or inf would make max/min depend on the order
        found = [m for m in metrics if isinstance(m, dict) and (type(m.get(name)) is int or (
                 type(m.get(name)) is float and math.isfinite(m[name])))]
        if found:
            best = (max if mode == "max" else min)(found, key=lambda m: m[name])
            return {"name": name, "mode": mode, "value": best[name], "step": best.get("step")}
    return None


def sweep_status(sweep_dir: Path, task_status: Callable[[Path, str | None, str | None], dict[str, Any]]) -> dict[str, Any]:
    """The sweep as rows: task, values, state, step, best metric. `task_status(run_dir, job_id, executor)`
    is `watch.status.run_status` (with the array's scheduler states asked for once)."""
    sweep = read_sweep(sweep_dir)
    rows = []
    for task in sweep.get("tasks", []):
        run_dir = Path(sweep_dir) / str(task.get("run_dir"))
        subs = read_jsonl(RunDir(run_dir).submissions)
        job_id = subs[-1].get("job_id") if subs else None
        info = task_status(run_dir, job_id, subs[-1].get("executor") if subs else sweep.get("executor")) \
            if RunDir(run_dir).spec.is_file() else {"state": "NOT SUBMITTED", "step": None, "total_steps": None}
        rows.append({"task": task.get("index"), "values": task.get("values", {}), "job_id": job_id,
                     "state": info["state"], "step": info["step"], "total_steps": info["total_steps"],
                     "restarts": info.get("restarts", 0), "run_dir": str(run_dir),
                     "best": best_metric(read_jsonl(RunDir(run_dir).metrics), sweep.get("metric"))})
    return {"sweep_dir": str(sweep_dir), "array_job_id": sweep.get("array_job_id"), "executor": sweep.get("executor"),
            "max_running": sweep.get("max_running"), "metric": sweep.get("metric"), "tasks": rows}


def format_sweep(info: Mapping[str, Any]) -> Iterator[str]:
    rows = info["tasks"]
    states: dict[str, int] = {}
    for row in rows:
        states[row["state"]] = states.get(row["state"], 0) + 1
    array = f"array job {info['array_job_id']}" if info.get("array_job_id") else info.get("executor") or "?"
    yield f"sweep {info['sweep_dir']}  ({array}; {len(rows)} tasks: " + \
        ", ".join(f"{n} {s}" for s, n in sorted(states.items())) + ")"
    table = [("task", "values", "state", "step", "best", "job")]
    for row in rows:
        best = row["best"]
        table.append((str(row["task"]), describe(row["values"]), row["state"] + (
            f" ({row['restarts']} restarts)" if row["restarts"] else ""),
            f"{row['step']}/{row['total_steps']}" if row["step"] is not None and row["total_steps"]
            else str(row["step"] if row["step"] is not None else "-"),
            f"{best['name']} {best['value']:.4g}" if best else "-", str(row["job_id"] or "-")))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        yield "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip()
    leader = _leader(rows)
    if leader:
        yield f"best so far: task {leader['task']} ({describe(leader['values'])}): " \
              f"{leader['best']['name']} {leader['best']['value']:.4g} at step {leader['best']['step']}"


def _leader(rows: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    scored = [r for r in rows if r["best"]]
    if not scored or len({(r["best"]["name"], r["best"]["mode"]) for r in scored}) != 1:
        return None
    pick = max if scored[0]["best"]["mode"] == "max" else min
    return pick(scored, key=lambda r: r["best"]["value"])
