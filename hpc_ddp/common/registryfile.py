"""Where this user's registry of runs lives and how a record is added to it: one JSON line per submission
in $XDG_DATA_HOME/hpc-ddp/runs.jsonl (default ~/.local/share; HPC_DDP_REGISTRY overrides). The login
node's commands read it (`watch.registry`); the requeue fallback on a compute node adds to it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.common.events import JsonLines, read_jsonl

__all__ = ["registry_path", "register", "records"]


def registry_path(env: Mapping[str, str] = os.environ) -> Path:
    if env.get("HPC_DDP_REGISTRY"):
        return Path(env["HPC_DDP_REGISTRY"])
    base = Path(env.get("XDG_DATA_HOME") or Path(env.get("HOME", "~")).expanduser() / ".local" / "share")
    return base / "hpc-ddp" / "runs.jsonl"


# A record's keys -> the types hpc-ddp writes there. A line with another type in one of them (a list for a
# host, a table for a run dir: another tool's line, or an edit gone wrong) is left out of every command's view
# of the registry, so no command stops on it or passes it on.
_TYPES: dict[str, tuple[type, ...]] = {
    "job_id": (str, int), "run_dir": (str,), "executor": (str,), "name": (str,), "time": (int, float, str),
    "host": (str,), "remote_hpc_ddp": (str,), "sweep": (str,), "task": (int,), "values": (dict,),
    "array_job_id": (str, int), "slurm": (dict,),
}


def well_formed(record: Any) -> bool:
    """A registry line as hpc-ddp writes it: a table, each known key of its type or null."""
    return isinstance(record, dict) and all(
        record.get(key) is None or (isinstance(record[key], types) and not isinstance(record[key], bool))
        for key, types in _TYPES.items())


def records(env: Mapping[str, str] = os.environ, left_out: list[Any] | None = None) -> list[dict[str, Any]]:
    """The registry's records that are well formed (`well_formed`), oldest first; the others are added to
    `left_out` where one is given (a command that lists them says how many it left out)."""
    found = []
    for record in read_jsonl(registry_path(env)):
        if well_formed(record):
            found.append(record)
        elif left_out is not None:
            left_out.append(record)
    return found


def register(record: dict[str, Any], env: Mapping[str, str] = os.environ) -> None:
    path = registry_path(env)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    JsonLines(path).write(record)
