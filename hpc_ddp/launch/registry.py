"""A small registry of this user's runs, so `hpc-ddp list/status/logs/cancel JOB_ID` work from any
directory: one JSON line per submission in $XDG_DATA_HOME/hpc-ddp/runs.jsonl (default ~/.local/share)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.events import JsonLines, read_jsonl
from hpc_ddp.common.rundir import RunDir

__all__ = ["registry_path", "register", "runs", "find_run"]


def registry_path(env: Mapping[str, str] = os.environ) -> Path:
    if env.get("HPC_DDP_REGISTRY"):
        return Path(env["HPC_DDP_REGISTRY"])
    base = Path(env.get("XDG_DATA_HOME") or Path(env.get("HOME", "~")).expanduser() / ".local" / "share")
    return base / "hpc-ddp" / "runs.jsonl"


def register(record: dict[str, Any], env: Mapping[str, str] = os.environ) -> None:
    path = registry_path(env)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    JsonLines(path).write(record)


def runs(env: Mapping[str, str] = os.environ) -> list[dict[str, Any]]:
    return read_jsonl(registry_path(env))


def find_run(ref: str, env: Mapping[str, str] = os.environ) -> tuple[Path, str | None, str | None]:
    """(run dir, job id, executor) for a job id or a run dir."""
    path = Path(ref).expanduser()
    if path.is_dir():
        subs = read_jsonl(RunDir(path).submissions)
        last = subs[-1] if subs else {}
        return path.resolve(), last.get("job_id"), last.get("executor")
    for record in reversed(runs(env)):
        if str(record.get("job_id")) == ref:
            return Path(record["run_dir"]), ref, record.get("executor")
    raise UserError(f"no run dir or known job {ref!r}",
                    hint="give the run dir, or a job id from `hpc-ddp list`")
