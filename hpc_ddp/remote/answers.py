"""What the cluster's side says over ssh, read here once into typed values (issue 53): the hello of
`submit --ssh` (key=value lines), submit's JSON answer, an entry of `logs -f --from`, the debugger of
`status --json`, the records of `list --json`, and the picture a remote `timeline` wrote.

Whatever the other side prints (an old hpc-ddp, a login banner, a damaged file, a hostile account) is
validated here: each value of its type, text printable, paths absolute, ids Slurm's, numbers bounded. An
optional value that is not is dropped (None); an answer a decision needs whole is refused with a UserError
that names what is wrong. The callers decide on these values alone, never on the raw text. Pure.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.common.errors import UserError

__all__ = ["DebugTarget", "Hello", "LogEntry", "Submitted", "Task", "parse_debug_target", "parse_hello",
           "parse_log_entry", "parse_run_states", "parse_submitted", "parse_wrote"]

JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}")   # what Slurm (or the local executor) names a job
_STATES = frozenset({"link", "ours", "empty", "foreign", "absent"})   # the hello's words for the mirror folder
_MAX_KB_DIGITS = 18   # free space past an exabyte is no reading


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value.isprintable() else None


def _folder(value: Any) -> str | None:
    return value if isinstance(value, str) and value.startswith("/") and value.isprintable() else None


def _job_id(value: Any) -> str | None:
    return str(value) if type(value) in (int, str) and JOB_ID.fullmatch(str(value)) else None


# ---------------------------------------------------------------------------------------------- hello


@dataclass(frozen=True)
class Hello:
    """The cluster's answer to submit's first call. `version`: its hpc-ddp's `--version` line, None where
    there is none; `dir`: the mirror folder, absolute (None: not said, or not a path); `state`: one of
    link, ours, empty, foreign, absent (None: another word); `origin`: the project the mirror holds, as
    written there (JSON text); `mark`: "link" or "notdir" where hpc-ddp's own folder there is not one;
    `blocked`: the encoded name of a folder of the project that is a link or a file there; `free_kb`: free
    space where the mirror goes (None: not a number); `writable`: False where it is not."""
    version: str | None
    rsync: str | None
    dir: str | None
    state: str | None
    origin: str | None = None
    mark: str | None = None
    blocked: str | None = None
    free_kb: int | None = None
    writable: bool = True
    unwritable: str | None = None


def parse_hello(text: str) -> Hello:
    """The hello's key=value lines (the last of each key wins: a login banner's lines come before the
    script's own; lines without "=" are skipped)."""
    said: dict[str, str] = {}
    for line in text.splitlines():
        key, eq, value = line.partition("=")
        if eq:
            said[key] = value
    version = said.get("version", "missing")
    free = said.get("free_kb", "")
    return Hello(
        version=None if version == "missing" or not version.strip() else version.strip(),
        rsync=_text(said.get("rsync")),
        dir=_folder(said.get("dir")),
        state=said.get("state") if said.get("state") in _STATES else None,
        origin=said.get("origin"),
        mark=said.get("mark") if said.get("mark") in ("link", "notdir") else None,
        blocked=said.get("blocked") or None,
        free_kb=int(free) if free.isascii() and free.isdigit() and len(free) <= _MAX_KB_DIGITS else None,
        writable=said.get("writable") != "no",
        unwritable=_folder(said.get("unwritable")),
    )


# --------------------------------------------------------------------------------------------- submit


@dataclass(frozen=True)
class Task:
    """One task of a sweep the cluster queued."""
    task: int | None
    job_id: str | None
    run_dir: str | None
    values: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Submitted:
    """The cluster's `submit --json` answer. `raw`: the table as answered (for `--json` and a dry run's
    script, which are shown through `printable`); `job_ids`: every job queued (a chain's, in order);
    `tasks`: a sweep's (None for one run)."""
    raw: Mapping[str, Any]
    executor: str | None
    run_dir: str | None
    job_ids: tuple[str, ...]
    tasks: tuple[Task, ...] | None = None
    sweep_dir: str | None = None
    array_job_id: str | None = None


def parse_submitted(answer: Any, host: str) -> Submitted:
    """The cluster's answer (parsed JSON), every value this laptop prints or records of its type: job ids
    as Slurm's (never an option, a newline or an escape), run dirs absolute and printable (a registry
    record that names "--json" would become an option of every command forwarded for it). A UserError
    naming the first that is not: the job may be queued there all the same."""
    def bad(problem: str) -> UserError:
        return UserError(f"the answer of {host}'s hpc-ddp cannot be used here ({problem} is not what hpc-ddp "
                         "writes): nothing was recorded", hint=f"the job may be queued there: look with `ssh {host} "
                         "hpc-ddp list`; install the same hpc-ddp version on both sides")

    def ok(value: Any, check) -> bool:
        return value is None or check(value) is not None

    if not isinstance(answer, dict):
        raise bad(f"a {type(answer).__name__}, not a table")
    if not ok(answer.get("executor"), _text):
        raise bad("its executor")
    if "tasks" in answer:
        tasks = answer["tasks"]
        if not isinstance(tasks, list) or not all(isinstance(t, dict) for t in tasks):
            raise bad("its tasks")
        if not ok(answer.get("sweep_dir"), _folder) or not ok(answer.get("array_job_id"), _job_id):
            raise bad("its sweep dir or array job id")
        if not all(ok(t.get("job_id"), _job_id) and ok(t.get("run_dir"), _folder)
                   and isinstance(t.get("values") or {}, dict) and (t.get("task") is None or type(t.get("task")) is int)
                   for t in tasks):
            raise bad("a task's job id, run dir, number or values")
        return Submitted(answer, answer.get("executor"), None, (),
                         tuple(Task(t.get("task"), _job_id(t.get("job_id")), t.get("run_dir"), t.get("values") or {})
                               for t in tasks),
                         answer.get("sweep_dir"), _job_id(answer.get("array_job_id")))
    if not ok(answer.get("run_dir"), _folder) or not ok(answer.get("job_id"), _job_id):
        raise bad("its run dir or job id")
    ids = answer.get("job_ids")
    if ids is not None and not (isinstance(ids, list) and all(j is not None and _job_id(j) for j in ids)):
        raise bad("its job ids")
    job_ids = tuple(_job_id(j) for j in (ids or [answer.get("job_id")]) if j is not None)
    return Submitted(answer, answer.get("executor"), answer.get("run_dir"), job_ids)


# ------------------------------------------------------------------------------------------- logs -f


@dataclass(frozen=True)
class LogEntry:
    """A line of the cluster's `logs -f --from`: which file, where the line ends in it, which part of a
    long line, and the line; `attempt` and `rank` where it is a rank's."""
    path: str
    end: int
    part: int
    parts: int
    line: str
    attempt: int | None = None
    rank: int | None = None


def parse_log_entry(raw: bytes | str) -> LogEntry | None:
    """One line of `logs -f --from` output, or None where it is not an entry as the cluster writes them
    (each value of its type; offsets and parts not negative)."""
    try:
        entry = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(entry, dict):
        return None
    ints = [entry.get(k) for k in ("end", "part", "parts")]
    optional = [entry.get(k) for k in ("attempt", "rank")]
    if not (isinstance(entry.get("path"), str) and isinstance(entry.get("line"), str)
            and all(type(v) is int and v >= 0 for v in ints) and all(v is None or type(v) is int for v in optional)):
        return None
    return LogEntry(entry["path"], entry["end"], entry["part"], entry["parts"], entry["line"],
                    entry.get("attempt"), entry.get("rank"))


# ------------------------------------------------------------------------------------------- debugger


@dataclass(frozen=True)
class DebugTarget:
    """The rank waiting for a debugger, as the cluster's `status --json` says: its node, its port there,
    the Unix socket of the user's on the login node that `hpc-ddp attach` serves, and the rank."""
    node: str
    port: int
    login_socket: str
    rank: int | None


def parse_debug_target(stdout: bytes | str) -> DebugTarget | None:
    """The debugger of a `status --json` answer, or None where no rank waits (or the answer is not one):
    a port of True or 99999 is no port, a relative socket no path to forward to, and one not served for
    its owner alone is never tunnelled."""
    try:
        answer = json.loads(stdout)
    except ValueError:
        return None
    debug = answer.get("debugger") if isinstance(answer, dict) else None
    if not isinstance(debug, dict):
        return None
    node, port, sock, rank = debug.get("node"), debug.get("port"), debug.get("login_socket"), debug.get("rank")
    if not (isinstance(node, str) and node and node.isprintable()) or type(port) is not int \
            or not 0 < port < 65536 or _folder(sock) is None or debug.get("owner_only") is not True:
        return None
    return DebugTarget(node, port, sock, rank if type(rank) is int else None)


# ----------------------------------------------------------------------------------------------- list


def parse_run_states(stdout: bytes | str) -> dict[str, Mapping[str, Any]]:
    """`list --json`'s records -> job id -> the Slurm state table each carries; records that are not
    tables, or whose job id or state is not of its type, are left out. ValueError where the answer is not
    a JSON list at all."""
    records = json.loads(stdout)
    if not isinstance(records, list):
        raise ValueError(f"a {type(records).__name__}, not a list of runs")
    found: dict[str, Mapping[str, Any]] = {}
    for record in records:
        if isinstance(record, dict) and _job_id(record.get("job_id")) and isinstance(record.get("slurm"), dict):
            found[str(record["job_id"])] = record["slurm"]
    return found


# ------------------------------------------------------------------------------------------- timeline


def parse_wrote(text: str) -> tuple[str | None, list[str]]:
    """A remote `timeline`'s output: (the absolute path of the picture it wrote, from its first "Wrote PATH"
    line; None where there is none that is one), and its other lines."""
    drawn, others = None, []
    for line in text.splitlines():
        if line.startswith("Wrote "):
            drawn = drawn or _folder(line[len("Wrote "):])
        else:
            others.append(line)
    return drawn, others
