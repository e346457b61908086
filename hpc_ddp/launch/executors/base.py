"""The executor protocol and the values that cross it: Plan (pure), Submission (what happened) and Run
(a submitted job, as the registry or its run dir recalls it).

An executor does the whole job for its kind of run: plan it, submit it, then say how it is (`state`),
cancel it and signal it. Commands ask the executor the run was submitted with (`executor_for_run`),
never switch on its name."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from hpc_ddp.common.durable import append, write_file
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["Plan", "Submission", "Run", "Executor", "write_run_dir", "record_submission"]


@dataclasses.dataclass(frozen=True)
class Plan:
    executor: str
    spec: JobSpec
    run_dir: str
    script: str | None          # the exact batch script, where there is one
    summary: str                # what --dry-run prints when there is no script

    def dry_run_text(self) -> str:
        return self.script if self.script is not None else self.summary


@dataclasses.dataclass(frozen=True)
class Submission:
    executor: str
    job_id: str
    run_dir: str
    script: str | None          # path of the written script, where there is one
    state: str = "SUBMITTED"    # local runs finish before returning: COMPLETED / FAILED
    returncode: int | None = None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Run:
    """A submitted run: its dir, its job id (None before one is known) and the executor's name."""

    run_dir: Path
    job_id: str | None
    executor: str | None

    @property
    def paths(self) -> RunDir:
        return RunDir(self.run_dir)


class Executor(Protocol):
    name: str
    # Its jobs wait in a Slurm queue: they are checked against the cluster before they are submitted
    # (preflight), and Slurm's accounting knows them.
    queues: bool

    def plan(self, spec: JobSpec, run_dir: str) -> Plan: ...

    def check(self, plan: Plan) -> Any:
        """Refuse (a UserError) what the executor cannot run, before anything is written: submit calls it
        before it takes the code snapshot, and `submit` itself calls it again."""

    def submit(self, plan: Plan, on_job_id: Callable[[str], None] | None = None) -> Submission:
        """Start the job. `on_job_id` is called as soon as the job has an id (before a local run starts,
        which may last hours), so the run can be found while it runs."""

    def state(self, run: Run) -> dict[str, Any]:
        """What the scheduler says about the run now ({'state', 'reason', 'source', ...}); {} if nothing."""

    def cancel(self, run: Run) -> str:
        """Stop the run for good (the ranks checkpoint first where they can); a line saying what was done."""

    def signal(self, run: Run, name: str) -> None:
        """Send signal `name` (USR2, TERM, ...) to every rank of the run."""


def write_run_dir(plan: Plan) -> Path:
    """Create the run dir with the spec every rank will load.

    spec.json is the one file that keeps the program's arguments unmasked: it is how they reach every rank
    (the runner builds argv from it, on every requeue too), so a `--token ...` argument must stay as given.
    It is created readable by the user alone instead; everything else hpc-ddp writes is masked."""
    run_dir = Path(plan.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # checkpoints and logs: the user's alone
    RunDir(run_dir).logs.mkdir(exist_ok=True, mode=0o700)
    _write_private(RunDir(run_dir).spec, json.dumps(plan.spec.to_dict(), indent=2) + "\n")
    return run_dir


def record_submission(sub: Submission) -> None:
    path = RunDir(sub.run_dir).submissions
    append(path, json.dumps(sub.to_json()) + "\n")


def _write_private(path: Path, text: str) -> None:
    """Atomically, mode 0600 from the moment the file exists (a chmod afterwards would leave a window)."""
    write_file(path, text, 0o600)
