"""Append-only JSON-lines records in the run dir: `events.jsonl` (what happened to the job) and
`metrics.jsonl` (training curves). One line per record, each flushed and fsynced, so a kill loses at
most the line being written and never corrupts the ones before it.

Every string in a record is masked (`secrets`) before it is written: event reasons and error texts can
quote a rank's output, and a token in it must not land on disk. Keys are ours and are not masked."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from hpc_ddp.common import secrets

__all__ = ["JsonLines", "read_jsonl"]


class JsonLines:
    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = secrets.current().deep({"time": round(time.time(), 3), **record})
        line = json.dumps(clean) + "\n"
        with open(self.path, "a") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every complete record; a torn last line (a kill mid-write) is skipped."""
    records = []
    with contextlib.suppress(FileNotFoundError):  # no file yet: no records
        with open(path) as fh:
            for line in fh:
                try:
                    records.append(json.loads(line))
                except ValueError:
                    continue
    return records
