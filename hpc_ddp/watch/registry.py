"""A small registry of this user's runs, so `hpc-ddp list/status/logs/cancel JOB_ID` work from any
directory: one JSON line per submission in $XDG_DATA_HOME/hpc-ddp/runs.jsonl (default ~/.local/share).
(The file and its writer: common/registryfile.py.) `resolve` turns what a command was given (a job id, a run dir, nothing) into the Run it means."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.events import read_jsonl
from hpc_ddp.common.registryfile import records, register, registry_path
from hpc_ddp.common.rundir import RunDir, is_sweep_dir
from hpc_ddp.launch.executors.base import Run
from hpc_ddp.launch.rundirs import existing_run_dir
from hpc_ddp.launch.sweep import read_sweep
from hpc_ddp.spec.jobspec import JobSpec

__all__ = ["registry_path", "register", "record_run", "runs", "find_run", "resolve"]


def runs(env: Mapping[str, str] = os.environ, left_out: list[Any] | None = None) -> list[dict[str, Any]]:
    """The registry's well-formed records (a damaged line is left out: `registryfile.records`)."""
    return records(env, left_out)


def find_run(ref: str, env: Mapping[str, str] = os.environ) -> tuple[Path, str | None, str | None]:
    """(run dir, job id, executor) for a job id or a run dir; a sweep's dir or array job id gives the
    sweep dir and the array's id."""
    path = Path(ref).expanduser()
    if is_sweep_dir(path):
        sweep = read_sweep(path)
        return path.resolve(), sweep.get("array_job_id"), sweep.get("executor")
    if path.is_dir():
        subs = [s for s in read_jsonl(RunDir(path).submissions) if isinstance(s, dict)]
        last = subs[-1] if subs else {}
        return path.resolve(), last.get("job_id"), last.get("executor")
    for record in reversed(runs(env)):
        if str(record.get("job_id")) == ref and record.get("run_dir"):
            return Path(record["run_dir"]), ref, record.get("executor")
        if str(record.get("array_job_id")) == ref and record.get("sweep"):
            return Path(record["sweep"]), ref, record.get("executor")
    raise UserError(f"no run dir or known job {ref!r}",
                    hint="give the run dir, or a job id from `hpc-ddp list`")


def record_run(spec: JobSpec, run_dir: str, job_id: str, executor: str,
               warn: Callable[[str], None], extra: Mapping[str, Any] | None = None) -> None:
    """Record a submission (`extra`: a sweep task's sweep dir, index and array job id); a registry that
    cannot be written (a read-only home) is a warning, never a reason to lose the submission."""
    try:
        register({"job_id": job_id, "executor": executor, "run_dir": run_dir, "name": spec.job_name,
                  "nodes": spec.nodes, "gpus": spec.gpus, **(extra or {})})
    except OSError as exc:
        warn(f"could not record the run in the registry: {exc}")


def resolve(ref: str | None, env: Mapping[str, str] = os.environ) -> Run:
    """The run a command names: a job id, a run dir, or (None) the most recent run; its run dir must
    still be one hpc-ddp made."""
    if ref is None:
        recent = runs(env)
        if not recent:
            raise UserError("no runs recorded yet", hint="give a job id or a run dir")
        ref = recent[-1].get("sweep") or recent[-1].get("run_dir")
        if not ref:
            raise UserError("the registry's last record names no run dir", hint="give a job id or a run dir")  # the last run, or the sweep it is a task of
    run_dir, job_id, executor = find_run(ref, env)
    if is_sweep_dir(run_dir):
        return Run(run_dir, job_id, executor)
    return Run(existing_run_dir(Path(run_dir), ref), job_id, executor)
