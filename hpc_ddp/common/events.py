"""Append-only JSON-lines records in the run dir: `events.jsonl` (what happened to the job) and
`metrics.jsonl` (training curves). One line per record, each flushed and fsynced, so a kill loses at
most the line being written and never corrupts the ones before it.

Every string in a record is masked (`secrets`) before it is written: event reasons and error texts can
quote a rank's output, and a token in it must not land on disk. Keys are ours and are not masked."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from hpc_ddp.common import secrets
from hpc_ddp.common.durable import NotRegularFile, append, file_kind
from hpc_ddp.common.errors import UserError

__all__ = ["JsonLines", "read_jsonl", "well_formed"]


class JsonLines:
    def __init__(self, path: str | os.PathLike, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = secrets.current().deep({"time": round(time.time(), 3), **record})
        line = json.dumps(clean) + "\n"
        try:
            append(self.path, line, durable=True)
        except NotRegularFile as exc:
            raise UserError(f"{self.path} {exc.strerror}",
                            hint="remove it: hpc-ddp writes its records itself, never through a link") from None


MAX_RECORDS_BYTES = 1 << 30   # a records file bigger than this is refused, not read into memory


def read_jsonl(path: str | os.PathLike, limit: int = MAX_RECORDS_BYTES) -> list[dict[str, Any]]:
    """Every complete record (a JSON object); a torn last line (a kill mid-write) is skipped, and so is a
    line that holds JSON of another kind. Only a regular file is read
    (through a link, as a dotfile manager makes them): a FIFO or a device in its place is refused at once,
    never waited on, and so is a file of more than `limit` bytes."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:  # no file yet: no records
        return []
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UserError(f"{os.fspath(path)} is {file_kind(st.st_mode)}, not a file of records: it is not read",
                            hint="remove it (hpc-ddp writes its records as a regular file)")
        if st.st_size > limit:
            raise UserError(f"{os.fspath(path)} holds {st.st_size:,} bytes of records, more than the {limit:,} hpc-ddp "
                            "reads", hint="move it away (it is not one hpc-ddp wrote), or archive the run")
        records = []
        read = 0
        for line in fh:
            read += len(line)
            if read > limit:  # it grew while read: what was there is enough
                break
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # a torn line, or one nested past Python's stack: damaged
                continue
            if isinstance(record, dict):  # a line that is JSON but no object ([1], "x", 3) is no record of ours
                records.append(record)
    return records


# The fields status, timeline and plot compute with, and the shape hpc-ddp writes them in. A record that
# has one in another shape (a string for a step, NaN or 1e308 for a time: edited, or written by another
# tool) was not written by hpc-ddp as it is, and is left out rather than crash or mislead the arithmetic.
_LATEST_TIME = 1e11          # the year 5138: later is no time of ours, and past what datetime can show
_COUNTS = ("attempt", "step", "total_steps", "batch_in_epoch", "checkpoint_step")
# Records that say which attempt they are about: their number is no optional field there.
_NUMBERED = ("attempt_start", "attempt_end")
_TEXTS = ("event", "reason", "cause", "executor", "state")


def _count(value: Any) -> bool:
    return value is None or (type(value) is int and 0 <= value < 1 << 53)


def well_formed(record: Any) -> bool:
    """Is `record` a dict whose time, counts (attempt, step, epoch, ...), exit code, texts and job id have
    the types and ranges hpc-ddp writes? (Fields it does not know are not judged.)"""
    if not isinstance(record, dict):
        return False
    when = record.get("time")
    if when is not None and not (type(when) in (int, float) and 0 <= when < _LATEST_TIME):  # NaN fails too
        return False
    code = record.get("exit_code")
    if code is not None and not (type(code) is int and -(1 << 31) <= code < 1 << 31):
        return False
    epoch = record.get("epoch")  # a whole number of ours, or a fraction a framework logs (HF: 1.5)
    if epoch is not None and not (type(epoch) in (int, float) and 0 <= epoch < 1 << 53):
        return False
    job = record.get("job_id")
    if record.get("event") in _NUMBERED and "attempt" in record and type(record["attempt"]) is not int:
        return False
    return (all(_count(record.get(k)) for k in _COUNTS) and all(isinstance(record.get(k), (str, type(None)))
            for k in _TEXTS) and (job is None or type(job) in (str, int)))
