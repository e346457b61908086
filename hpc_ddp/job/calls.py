"""A Python function as the program of every rank (`hpc_ddp.notebook`): the call a launcher hands to the
ranks, run on one rank, and what comes back. Both sides of the files live here, so their format is in one place.

    CALL_DIR/                   private to the user (0700): a pickle is code, so only we may write here
      call.pkl                  {"sys_path", "files", "call": cloudpickle of {"fn", "args", "kwargs"}}, by the launcher
      result.pkl                rank 0's return value (cloudpickle), written by rank 0 when fn returns
      error-<rank>.json         {"rank", "type", "message", "traceback", "time"}: fn raised on that rank

The function travels by value (cloudpickle), so a function defined in a notebook cell, with the classes and
globals it uses, reaches ranks that are fresh interpreters: plain pickle would send only its name, which a
fresh process cannot import. Modules are still sent by name, so the ranks get the launcher's sys.path.
The source files of the code sent by value go along ("files", `codefiles`), so a rank's traceback names
them, whatever name cloudpickle gives them.

`python -m hpc_ddp.job.calls CALL_DIR` runs the call as one rank, with the rank's environment already set by
whoever started it; exit 0 when fn returned, 1 when it raised (the record says what, and where). Under Slurm,
submitit starts `SlurmRank` on every task instead: it gives the task its rank environment (the per-rank
runner's), then does the same.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.common.durable import write_file
from hpc_ddp.job import codefiles

__all__ = ["CALL", "RESULT", "write_call", "load_call", "invoke", "failure_record", "write_failure", "read_failures",
           "write_result", "read_result", "SlurmRank", "CALL_DIR", "main"]

CALL_DIR = "call"          # inside a run dir (hpc_ddp.notebook.submit)
CALL = "call.pkl"
RESULT = "result.pkl"
ERROR = "error-{rank}.json"


class Failure(Exception):
    """What `invoke` raises when the function raised on this rank: the record, already written."""

    def __init__(self, record: Mapping[str, Any]):
        super().__init__(f"rank {record['rank']}: {record['type']}: {record['message']}")
        self.record = dict(record)


def write_call(call_dir: Path, fn: Callable, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    import cloudpickle

    call = cloudpickle.dumps({"fn": fn, "args": tuple(args), "kwargs": dict(kwargs)})
    files = codefiles.files_of(fn, *args, *kwargs.values())
    # sys.path apart from the call: the rank needs it to import the modules the call names, before loading it.
    _write_private(call_dir / CALL, pickle.dumps({"sys_path": list(sys.path), "files": files, "call": call}))


def load_call(call_dir: Path) -> tuple[Callable, tuple, dict]:
    """The call, after the launcher's sys.path entries this process lacks are added (after its own: the
    rank's interpreter keeps its own stdlib and site-packages first)."""
    import cloudpickle

    outer = pickle.loads((call_dir / CALL).read_bytes())
    sys.path.extend(p for p in outer["sys_path"] if p not in sys.path)
    call = cloudpickle.loads(outer["call"])
    codefiles.restore_files((call["fn"], *call["args"], *call["kwargs"].values()), outer.get("files") or {})
    return call["fn"], call["args"], call["kwargs"]


def failure_record(exc: BaseException, rank: int, *, skip: int = 0) -> dict[str, Any]:
    """What one rank's exception becomes: its type, message and traceback text (less our own `skip`
    outermost frames), and when (the first failure in time is the cause; the others are usually peers that
    lost it)."""
    tb = exc.__traceback__
    for _ in range(skip):
        tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
    return {"rank": rank, "type": type(exc).__qualname__, "message": str(exc),
            "traceback": "".join(traceback.format_exception(type(exc), exc, tb)), "time": time.time()}


def invoke(fn: Callable, args: Sequence[Any], kwargs: Mapping[str, Any], rank: int, out_dir: Path) -> Any:
    """fn(*args, **kwargs) on this rank. If it raises (SystemExit with a code other than 0 included), the
    failure is written to out_dir and raised again as `Failure`; sys.exit(0) counts as returning None."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as exc:
        if exc.code in (None, 0):
            return None
        record = failure_record(exc, rank, skip=1)
        record["message"] = f"sys.exit({exc.code!r})"
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: the launcher must hear of it
        record = failure_record(exc, rank, skip=1)
    write_failure(out_dir, record)
    raise Failure(record)


def write_failure(out_dir: Path, record: Mapping[str, Any]) -> None:
    _write_private(out_dir / ERROR.format(rank=int(record["rank"])), json.dumps(record).encode())


def read_failures(out_dir: Path) -> list[dict[str, Any]]:
    """Every rank's failure record, first in time first."""
    records = []
    for path in out_dir.glob(ERROR.format(rank="*")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # a rank killed mid-write: its exit code will speak for it
            continue
    return sorted(records, key=lambda r: (r.get("time", 0), r.get("rank", 0)))


def write_result(out_dir: Path, value: Any) -> None:
    import cloudpickle

    _write_private(out_dir / RESULT, cloudpickle.dumps(value))


def read_result(out_dir: Path) -> Any:
    import cloudpickle

    return cloudpickle.loads((out_dir / RESULT).read_bytes())


def _write_private(path: Path, data: bytes) -> None:
    """Whole or not at all (a temp name, then a rename), and the user's alone from the start."""
    write_file(path, data, 0o600)


def run_rank(call_dir: Path, rank: int) -> int:
    """One rank: load the call, run it, leave the outcome in call_dir. The exit code says which."""
    try:
        fn, args, kwargs = load_call(call_dir)
    except BaseException as exc:  # noqa: BLE001 - an import the rank cannot do: the launcher must say so
        record = failure_record(exc, rank)
        record["message"] = f"could not load the function on rank {rank}: {exc}"
        if isinstance(exc, ImportError):
            record["message"] += (" (the call names a module the rank cannot import: install it where the ranks run, "
                                  "or send it by value with cloudpickle.register_pickle_by_value(module))")
        write_failure(call_dir, record)
        return 1
    try:
        value = invoke(fn, args, kwargs, rank, call_dir)
    except Failure:
        return 1
    if rank == 0:
        try:
            write_result(call_dir, value)
        except Exception as exc:  # noqa: BLE001 - a value that cannot travel back is rank 0's failure
            record = failure_record(exc, rank)
            record["message"] = f"rank 0's return value cannot be pickled: {exc}"
            write_failure(call_dir, record)
            return 1
    return 0


class SlurmRank:
    """What submitit runs on every task of `hpc_ddp.notebook.submit`: the rank environment hpc-ddp's runner
    gives every rank, set in this process (CUDA reads CUDA_VISIBLE_DEVICES at its first use, later), then
    the call in RUN_DIR/call. Only the spec's path is pickled: the call itself loads after sys.path is set."""

    def __init__(self, spec_path: str):
        self.spec_path = spec_path

    def __call__(self) -> None:
        from hpc_ddp.common.machine import physical_gpus
        from hpc_ddp.job.distenv import from_environ
        from hpc_ddp.job.runner import clean_environ, rank_environment
        from hpc_ddp.spec.jobspec import load_spec

        spec, run_dir = load_spec(self.spec_path), Path(self.spec_path).parent
        base = clean_environ(os.environ)
        dist = from_environ(base, pid=os.getpid())
        os.environ.update(rank_environment(spec, dist, base, str(run_dir), nvidia_driver=physical_gpus() > 0))
        _guard_gpus()
        if run_rank(run_dir / CALL_DIR, dist.rank):  # the record is written; the task must fail, for Slurm
            raise RuntimeError(f"rank {dist.rank} failed: see {run_dir / CALL_DIR / ERROR.format(rank=dist.rank)}")


def _guard_gpus() -> None:
    """What the runner's sitecustomize does for a script's rank: start on the rank's own GPU, stop ranks
    that share one (job/exitsite/hpc_ddp_rankguard.py)."""
    from hpc_ddp.job.exitsite.hpc_ddp_rankguard import install

    install()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or "RANK" not in os.environ:
        sys.exit("usage: RANK=N ... python -m hpc_ddp.job.calls CALL_DIR (started by hpc_ddp.notebook.launch)")
    # The exit handlers run (the Session API leaves its process group there, bounded in time), but not the
    # C++ static destructors, which sometimes abort a rank whose function returned (torch's gloo threads).
    from hpc_ddp.common.procs import exit_after_handlers

    _guard_gpus()
    exit_after_handlers(run_rank(Path(args[0]), int(os.environ["RANK"])))


if __name__ == "__main__":
    main()
