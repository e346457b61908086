"""The executor protocol and the two values that cross it: Plan (pure) and Submission (what happened)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Protocol

from ..render import SPEC_NAME
from ..spec import JobSpec

__all__ = ["Plan", "Submission", "Executor", "write_run_dir"]


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


class Executor(Protocol):
    name: str

    def plan(self, spec: JobSpec, run_dir: str) -> Plan: ...

    def submit(self, plan: Plan) -> Submission: ...


def write_run_dir(plan: Plan) -> Path:
    """Create the run dir (private to the user) with the spec every rank will load."""
    run_dir = Path(plan.run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True, mode=0o700)
    _write_atomic(run_dir / SPEC_NAME, json.dumps(plan.spec.to_dict(), indent=2) + "\n")
    return run_dir


def record_submission(sub: Submission) -> None:
    path = Path(sub.run_dir) / "submissions.jsonl"
    with open(path, "a") as fh:
        fh.write(json.dumps(sub.to_json()) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
