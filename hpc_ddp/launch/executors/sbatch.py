"""The sbatch executor: render the batch script into the run dir and hand it to `sbatch`.

Also the jobs that wait for other jobs: an --after dependency is checked against Slurm before anything
is written (Slurm itself drops a dependency on a job it does not know and starts the job at once);
--chain N queues the run's later jobs up front, each waiting for the one before. Chain links are recorded
in submissions.jsonl (`job.chain`, which also queues the requeue fallback's job from the compute node).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from hpc_ddp.common.durable import write_file
from hpc_ddp.common.errors import HpcDdpError, SubmitError, UserError
from hpc_ddp.common.procs import CommandRunner, SubprocessCommands, slurm_unreachable
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.job.chain import link, record
from hpc_ddp.launch.executors.base import Plan, Submission, record_submission, write_run_dir
from hpc_ddp.launch.executors.slurmctl import SlurmControl
from hpc_ddp.launch.render import render_sbatch
from hpc_ddp.slurm.queue import SchedulerRefused, sbatch
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["SbatchExecutor", "SbatchSubmission", "SchedulerRefused", "check_dependency", "dependency_problem",
           "job_state", "sbatch"]


@dataclasses.dataclass(frozen=True)
class SbatchSubmission(Submission):
    job_ids: tuple[str, ...] = ()   # every job queued, in order: one, or the jobs of a --chain


class SbatchExecutor(SlurmControl):
    name = "sbatch"
    restarts_in_place = True  # its batch script restarts a crashed or shrunk step inside the allocation (--max-restarts)
    chains = True  # queues jobs that wait for other jobs: --after, --chain
    arrays = True  # queues a sweep as one Slurm array (`submit_array`)

    def __init__(self, commands: CommandRunner | None = None, *, generated_at: str = "", command_line: str = ""):
        self.commands = commands or SubprocessCommands()
        self.generated_at = generated_at
        self.command_line = command_line

    def plan(self, spec: JobSpec, run_dir: str) -> Plan:
        script = render_sbatch(spec, run_dir, generated_at=self.generated_at, command_line=self.command_line)
        return Plan("sbatch", spec, run_dir, script, summary=script)

    def check(self, plan: Plan) -> None:
        """Refusals that ask the cluster, before anything is written (the snapshot included)."""
        if plan.spec.after:  # a bad dependency submits nothing
            check_dependency(plan.spec.after, self.commands)

    def submit(self, plan: Plan, on_job_id=None) -> SbatchSubmission:
        self.check(plan)
        run_dir = write_run_dir(plan)
        script_path = _write_script(run_dir, plan.script)
        # sbatch runs in the run dir: the script's relative log paths resolve there, on every requeue too.
        job_id = sbatch(self.commands, run_dir)
        sub = Submission("sbatch", job_id, str(run_dir), str(script_path))
        record_submission(sub)
        if on_job_id is not None:
            on_job_id(job_id)
        later = self._queue_chain(sub, plan.spec.chain, on_job_id)
        return SbatchSubmission(**dataclasses.asdict(sub), job_ids=(job_id, *later))

    def plan_array(self, tasks, max_running: int | None) -> str:
        """The array script of a sweep's planned tasks (`launch.sweep.Task`)."""
        from hpc_ddp.launch.render import render_array
        from hpc_ddp.launch.sweep import array_directives

        return render_array(tasks=tasks, directives=array_directives(tasks[0].plan.spec, len(tasks), max_running),
                            max_running=max_running, generated_at=self.generated_at, command_line=self.command_line)

    def submit_array(self, plan, on_job_id) -> list[Submission]:
        """A sweep (`launch.sweep.SweepPlan`) as one array: every task's run dir and job script written,
        then the array script queued from the sweep dir; each task recorded under its own id,
        <array>_<task>, which is how Slurm shows, requeues and cancels it."""
        first = plan.tasks[0].plan.spec
        if first.after:  # before anything is written: a bad dependency submits nothing
            check_dependency(first.after, self.commands)
        for task in plan.tasks:
            _write_script(write_run_dir(task.plan), task.plan.script)
        _write_script(Path(plan.sweep_dir), plan.script)
        array_id = sbatch(self.commands, plan.sweep_dir)
        subs = []
        for task in plan.tasks:
            sub = Submission("sbatch", f"{array_id}_{task.index}", task.run_dir, str(RunDir(task.run_dir).script))
            record_submission(sub)
            on_job_id(task, sub.job_id)
            subs.append(sub)
        return subs

    def _queue_chain(self, first: Submission, length: int, on_job_id) -> list[str]:
        """Jobs 2..length of a --chain, each after the one before whatever its end (afterany: a job that
        stopped at its time limit is what the next one is for). They share the script and the run dir."""
        ids = [first.job_id]
        for position in range(2, length + 1):
            try:
                job_id = sbatch(self.commands, first.run_dir, dependency=f"afterany:{ids[-1]}")
            except HpcDdpError as exc:
                raise SubmitError(f"job {position} of the chain of {length} was not queued: {exc.message}; "
                                  f"job(s) {', '.join(ids)} were, and the run goes on in them",
                                  hint=f"to queue more later: hpc-ddp submit --after {ids[-1]}:any "
                                       f"--run-dir {first.run_dir} ...") from None
            record(first.run_dir, link(dataclasses.replace(first, job_id=job_id).to_json(), first.job_id, ids[-1],
                                       "chain"))
            if on_job_id is not None:
                on_job_id(job_id)
            ids.append(job_id)
        return ids[1:]


def _write_script(directory: Path, text: str | None) -> Path:
    path = RunDir(directory).script
    write_file(path, text or "", 0o700)
    return path


# ---- --after: the job waited for must exist, and be able to satisfy the dependency ----

# End states after which a job never satisfies afterok (Slurm leaves the dependent job pending forever,
# Reason=DependencyNeverSatisfied).
_ENDED_BADLY = frozenset({"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
                          "DEADLINE", "REVOKED"})
UNKNOWN = "?"  # Slurm could not be asked


def dependency_problem(after: str, state: str | None) -> tuple[str, str] | None:
    """(message, hint) when `after` ("afterok:ID"/"afterany:ID") cannot work, given the state Slurm has
    for the job (None: Slurm knows no such job; UNKNOWN: it could not be asked); None when it can."""
    kind, _, job = after.partition(":")
    if state is None:
        message = (f"--after {job}: Slurm knows no job {job} (not queued, not running, not recently ended, not in "
                   "accounting)")
        return message, (f"check the id with `sacct -j {job}`; Slurm drops a dependency on a job it does not know "
                         "and would start this one at once")
    if kind == "afterok" and state in _ENDED_BADLY:
        return (f"--after {job}: job {job} ended {state}, so a job waiting for its success would never start",
                f"use --after {job}:any to start after it whatever its end")
    return None


def job_state(job_id: str, commands: CommandRunner) -> str | None:
    """Slurm's state of `job_id` (PENDING, RUNNING, COMPLETED, FAILED, ...): from the controller, which
    knows the queued jobs and the recently ended ones, then from accounting. None: neither knows it;
    UNKNOWN: neither could be asked. Accounting's silence is no answer while the controller is unreachable:
    a job queued a minute ago is not in accounting yet."""
    from hpc_ddp.job.attempts import parse_show_job

    known_not = unreachable = False
    done = _ask(commands, ["scontrol", "show", "job", job_id])
    if done is not None and done.returncode == 0:
        state = parse_show_job(done.stdout).get("JobState")
        if state:
            return state
    elif done is not None:
        known_not = "Invalid job id" in done.stderr + done.stdout
        unreachable = slurm_unreachable(done.stderr + done.stdout)
    done = _ask(commands, ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"])
    if done is not None and done.returncode == 0:  # not without accounting ("accounting storage is disabled")
        words = done.stdout.split()
        if words or not unreachable:
            return words[0] if words else None  # "CANCELLED by 1000" -> CANCELLED
    return None if known_not else UNKNOWN


def _ask(commands: CommandRunner, argv: list[str]):
    """The command's answer, or None where it is not installed or did not answer in time."""
    if not commands.which(argv[0]):
        return None
    try:
        return commands.run(argv, timeout=30)
    except HpcDdpError:
        return None


def check_dependency(after: str, commands: CommandRunner) -> None:
    """Raise a UserError (exit 2, nothing submitted) when the job `after` names cannot be waited for."""
    job = after.partition(":")[2]
    state = job_state(job, commands)
    if state == UNKNOWN:
        print(f"hpc-ddp: warning: could not ask Slurm about job {job} (--after): it is not checked",
              file=sys.stderr)
        return
    problem = dependency_problem(after, state)
    if problem:
        raise UserError(problem[0], hint=problem[1])


def script_path(run_dir: str) -> Path:
    return RunDir(run_dir).script
