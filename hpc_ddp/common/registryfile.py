"""Where this user's registry of runs lives and how a record is added to it: one JSON line per submission
in $XDG_DATA_HOME/hpc-ddp/runs.jsonl (default ~/.local/share; HPC_DDP_REGISTRY overrides). The login
node's commands read it (`watch.registry`); the requeue fallback on a compute node adds to it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.common.events import JsonLines

__all__ = ["registry_path", "register"]


def registry_path(env: Mapping[str, str] = os.environ) -> Path:
    if env.get("HPC_DDP_REGISTRY"):
        return Path(env["HPC_DDP_REGISTRY"])
    base = Path(env.get("XDG_DATA_HOME") or Path(env.get("HOME", "~")).expanduser() / ".local" / "share")
    return base / "hpc-ddp" / "runs.jsonl"


def register(record: dict[str, Any], env: Mapping[str, str] = os.environ) -> None:
    path = registry_path(env)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    JsonLines(path).write(record)
