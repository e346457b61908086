"""DDP from a notebook: run a training function on N local ranks, or on Slurm through submitit, and get rank
0's return value back in the notebook.

    from hpc_ddp import notebook

    def train(steps):                       # defined in a cell: it travels by value
        import torch.distributed as dist
        dist.init_process_group("gloo")     # RANK, WORLD_SIZE, MASTER_ADDR/PORT are set on every rank
        ...
        return {"loss": loss}

    notebook.launch(train, 100, nprocs=2)                         # 2 ranks here; rank 0's return value
    job = notebook.submit(train, 100, nodes=2, tasks_per_node=2, partition="debug")
    job.result()                                                  # the same, from a Slurm job

How the function reaches the ranks. Each rank is a fresh interpreter, never a fork of the kernel: a fork
of a process that has initialised CUDA gets a CUDA context it cannot use, and a fork of a kernel (ipykernel
runs several threads) may copy a lock some other thread held, forever. The function, its arguments and
what they refer to are sent by value with cloudpickle (which submitit depends on), so a function or class
defined in a cell, which plain pickle would send by name only, works; modules go by name, and the ranks get
the notebook's sys.path and working directory to import them. The cost is an interpreter start and the
imports on every rank (a second or two for torch), paid once per call.

Every rank gets the environment hpc-ddp's per-rank runner gives its ranks (`job.runner.rank_environment`):
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR (127.0.0.1 here) and MASTER_PORT (a free one, below Linux's
ephemeral range), BACKEND (gloo on the CPU, nccl with gpus=), the timeouts, HPC_DDP_RUN_DIR. So a function
may call `init_process_group()` with env:// or use `hpc_ddp.start()`.

When a rank raises, `RankError` names it and carries its traceback text (the first rank to fail, in time: the
others usually failed because it left); the ranks still running get FAILURE_GRACE_S seconds, then they are
killed. `timeout=` kills every rank still running after that many seconds (`LaunchTimeout`, naming them);
Ctrl-C (the notebook's interrupt) kills them all too. No rank outlives the call, nor any process a rank
started (`spawn`: each rank runs under a supervisor that ends its whole process tree).

A `submit()` that fails (sbatch refuses the job, the call cannot be pickled) removes what it created for the
call, so that trying again is not refused; nothing that was there before is touched.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import math
import numbers
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time as _time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.common.errors import HpcDdpError, SpecError, UserError
from hpc_ddp.common.machine import physical_gpus
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.job import calls
from hpc_ddp.job.distenv import PORT_BASE, PORT_SPAN
from hpc_ddp.job.ports import first_free_port
from hpc_ddp.launch import spawn
from hpc_ddp.spec.jobspec import JobSpec, Layer, Target, build_spec

__all__ = ["launch", "submit", "SlurmCall", "RankError", "LaunchTimeout"]


class RankError(HpcDdpError):
    """A rank failed: `rank` (the first to, in time), `world_size`, `type` (the exception's class name, or
    None when the rank died without raising), `traceback` (its text), `others` (the ranks that failed after it)."""

    def __init__(self, message: str, *, rank: int, world_size: int, type: str | None = None, traceback: str = "",
                 others: Sequence[Mapping[str, Any]] = ()):
        super().__init__(message)
        self.rank, self.world_size, self.type, self.traceback = rank, world_size, type, traceback
        self.others = list(others)


class LaunchTimeout(RankError):
    """Ranks were still running at `timeout`; `ranks` lists them (all killed)."""

    def __init__(self, message: str, *, ranks: Sequence[int], world_size: int):
        super().__init__(message, rank=ranks[0], world_size=world_size)
        self.ranks = list(ranks)


# ---- here: N ranks on this machine ----

def launch(fn: Callable, *args: Any, nprocs: int = 2, gpus: int = 0, timeout: float | None = None,
           run_dir: str | os.PathLike | None = None, env: Mapping[str, str] | None = None, echo: bool = True,
           kwargs: Mapping[str, Any] | None = None) -> Any:
    """fn(*args, **kwargs) on `nprocs` ranks on this machine; rank 0's return value.

    gpus: GPUs the ranks share (0: none, gloo on the CPU; nprocs: one each, nccl). timeout: seconds before
    every rank still running is killed (None: no limit). run_dir: HPC_DDP_RUN_DIR of the ranks (where
    `hpc_ddp.start()` keeps checkpoints); by default a temporary one, removed afterwards. env: more variables
    for every rank. echo: show the ranks' output here, each line prefixed `[rank N]`."""
    _check_callable(fn)
    _check_timeout(timeout)
    env = _checked_env(env)
    spec = local_spec(nprocs, gpus, _job_name(fn))
    _check_gpus_here(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    with tempfile.TemporaryDirectory(prefix="hpc-ddp-call-") as tmp:  # 0700: only we may put a pickle there
        call_dir = Path(tmp)
        _pickle_call(call_dir, fn, args, kwargs or {})
        ranks_dir = _own_run_dir(run_dir) if run_dir is not None else str(call_dir)
        port = first_free_port(PORT_BASE + random.randrange(PORT_SPAN - 100))
        job_id = f"notebook-{os.getpid()}-{int(_time.time())}"
        base = {**os.environ, **env}
        driver = physical_gpus() > 0  # once: without /proc's entries it asks nvidia-smi
        envs = [spawn.rank_env(spec, rank, port, ranks_dir, job_id, base, nvidia_driver=driver)
                for rank in range(nprocs)]
        procs = spawn.start_ranks([sys.executable, "-m", "hpc_ddp.job.calls", str(call_dir)], envs, os.getcwd())
        ended = spawn.watch(procs, timeout=timeout, grace=spawn.FAILURE_GRACE_S, echo=echo)
        return local_outcome(call_dir, ended, timeout)


def local_spec(nprocs: Any, gpus: Any, name: str) -> JobSpec:
    """One node, `nprocs` ranks, checked as the CLI's spec is (a bad value is one line naming it)."""
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise SpecError(f"nprocs={nprocs!r}: give the number of ranks to start, 1 or more")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise SpecError(f"gpus={gpus!r}: give the number of GPUs the ranks share, 0 for none (gloo on the CPU)")
    if gpus and (nprocs > gpus or gpus % nprocs):
        raise SpecError(f"gpus={gpus} cannot be shared evenly by nprocs={nprocs} ranks",
                        hint=f"use gpus={nprocs} (one GPU per rank) or a multiple of it, or gpus=0")
    return build_spec([Layer("launch()", {"nodes": 1, "gpus": gpus, "tasks_per_node": nprocs, "job_name": name})],
                      target=Target("module", "hpc_ddp.job.calls"), workdir=os.getcwd(), python=sys.executable)


def local_outcome(call_dir: Path, ended: spawn.Ended, timeout: float | None) -> Any:
    """Rank 0's value, or the error that says which rank failed (or hung), and how."""
    world = len(ended.codes)
    failures = calls.read_failures(call_dir)
    if failures:
        raise rank_error(failures, world, killed=ended.killed)
    if ended.timed_out:
        raise timeout_error(ended.killed, world, timeout, ended.tails)
    if ended.first_failed is not None:
        rank = ended.first_failed
        raise RankError(died_message(rank, world, ended.codes[rank], ended.tails.get(rank, [])),
                        rank=rank, world_size=world)
    return calls.read_result(call_dir)


# ---- on Slurm, through submitit ----

UNKNOWN_FOR_S = 30.0

class SlurmCall:
    """A call submitted to Slurm: `result()` waits for rank 0's value; `cancel()`, `state()`, `job_id`, `run_dir`."""

    def __init__(self, job_id: str, run_dir: str, world_size: int):
        self.job_id, self.run_dir, self.world_size = job_id, run_dir, world_size
        self._silent_since: float | None = None

    def __repr__(self) -> str:
        return f"SlurmCall(job_id={self.job_id!r}, run_dir={self.run_dir!r})"

    def state(self) -> str:
        """Slurm's state of the job (squeue, then sacct, then scontrol), '' when Slurm says nothing."""
        from hpc_ddp.common.procs import SubprocessCommands
        from hpc_ddp.slurm.jobstate import scheduler_state

        return str(scheduler_state(self.job_id, SubprocessCommands()).get("state") or "")

    def done(self) -> bool:
        """The job has ended, as Slurm says. A job Slurm says nothing of (a moment's failure of squeue and
        sacct, or a record long expired) counts as ended only after UNKNOWN_FOR_S seconds of silence."""
        from hpc_ddp.watch.status import LIVE

        state = self.state()
        if state:
            self._silent_since = None
            return state not in (*LIVE, "SIGNALING", "STAGE_OUT")
        self._silent_since = self._silent_since or _time.monotonic()
        return _time.monotonic() - self._silent_since > UNKNOWN_FOR_S

    def cancel(self) -> None:
        subprocess.run(["scancel", self.job_id], check=False, capture_output=True)

    def log(self, rank: int = 0) -> str:
        """What rank `rank` printed (submitit's log of that task), '' before it started."""
        path = RunDir(self.run_dir).submitit / self.job_id / f"{self.job_id}_{rank}_log.out"
        return path.read_text(errors="replace") if path.is_file() else ""

    def result(self, timeout: float | None = None, poll: float = 1.0) -> Any:
        """Wait for the job to end, then rank 0's return value (or the RankError of the rank that failed).
        After `timeout` seconds the job is cancelled and LaunchTimeout raised. Ctrl-C stops the waiting, not
        the job: call result() again, or cancel()."""
        _check_timeout(timeout)
        start = _time.monotonic()
        while not self.done():
            if timeout is not None and _time.monotonic() - start > timeout:
                self.cancel()
                raise LaunchTimeout(f"job {self.job_id} still running after timeout={timeout:g} s: cancelled",
                                    ranks=list(range(self.world_size)), world_size=self.world_size)
            _time.sleep(poll)
        return slurm_outcome(Path(self.run_dir) / calls.CALL_DIR, self.world_size, self.job_id, self.state())


def submit(fn: Callable, *args: Any, nodes: int = 1, tasks_per_node: int = 1, gpus: int = 0,
           partition: str | None = None, time: str | int | None = None, run_dir: str | os.PathLike | None = None,
           kwargs: Mapping[str, Any] | None = None, **slurm: Any) -> SlurmCall:
    """fn(*args, **kwargs) on `nodes` x `tasks_per_node` ranks of a Slurm job, submitted with submitit; the
    returned SlurmCall's `result()` is rank 0's return value. More job options by their spec names
    (cpus_per_task, mem, account, qos, constraint, setup, sbatch_args, job_name, profile, ...). The run dir
    (default runs/NAME-YYYYmmdd-HHMMSS) holds the call, the outcome and the logs; `hpc-ddp status RUN_DIR`
    and `hpc-ddp logs RUN_DIR` read it as any run's."""
    import submitit

    from hpc_ddp.launch.executors.base import Plan, Submission, record_submission, write_run_dir
    from hpc_ddp.launch.executors.submitit_exec import submitit_parameters
    from hpc_ddp.launch.rundirs import new_run_dir
    from hpc_ddp.watch.registry import record_run

    _check_callable(fn)
    if shutil.which("sbatch") is None or shutil.which("srun") is None:  # before anything is written
        raise UserError("submit() queues a Slurm job, and there is no sbatch or srun on this machine",
                        hint="call it on a login node of the cluster, or use launch() to run on this machine")
    spec = slurm_spec({"nodes": nodes, "tasks_per_node": tasks_per_node, "gpus": gpus, "partition": partition,
                       "time": time, "run_dir": None if run_dir is None else str(run_dir), **slurm}, _job_name(fn))
    chosen = new_run_dir(spec, _dt.datetime.now())
    if (Path(chosen) / calls.CALL_DIR).exists():  # its outcome files would be taken for this call's
        raise UserError(f"run dir {chosen} already holds a call submitted earlier",
                        hint="give submit() a new run_dir, or none (runs/NAME-YYYYmmdd-HHMMSS)")
    with _removed_on_failure(Path(chosen)):  # sbatch may refuse it: a retry must not find a half-made call
        run = write_run_dir(Plan("submitit", spec, chosen, None, summary=""))
        call_dir = run / calls.CALL_DIR
        call_dir.mkdir(mode=0o700)
        _pickle_call(call_dir, fn, args, kwargs or {})
        executor = submitit.SlurmExecutor(folder=str(RunDir(run).submitit / "%j"), python=spec.python)
        params = submitit_parameters(spec)
        # One rank that raises ends the step, as under hpc-ddp's own srun: its peers may be blocked in a collective.
        params["srun_args"] = [*params.get("srun_args", []), "--kill-on-bad-exit=1"]
        executor.update_parameters(**params)
        job = _submitted(executor, calls.SlurmRank(str(RunDir(run).spec)))
    record_submission(Submission("submitit", str(job.job_id), str(run), None))
    record_run(spec, str(run), str(job.job_id), "submitit", warn=lambda m: print(f"hpc-ddp: warning: {m}", file=sys.stderr))
    return SlurmCall(str(job.job_id), str(run), spec.world_size)


def _submitted(executor: Any, rank: Any) -> Any:
    """submitit's submit, its failure one line: no sbatch here, or what sbatch said last (Slurm unreachable,
    a refused request) rather than submitit's whole multi-line text."""
    from hpc_ddp.common.errors import SubmitError

    try:
        return executor.submit(rank)
    except Exception as exc:  # noqa: BLE001 - submitit's FailedJobError and what it lets through
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        said = next((ln for ln in reversed(lines) if "error" in ln.lower() or "fatal" in ln.lower()), None) or (
            lines[-1] if lines else type(exc).__name__)
        raise SubmitError(f"sbatch did not queue the job: {said[:300]}",
                          hint="check that Slurm answers here (sinfo), and the job's options") from None


def slurm_spec(values: Mapping[str, Any], name: str) -> JobSpec:
    values = {"job_name": name, **{k: v for k, v in values.items() if v is not None}, "executor": "submitit"}
    return build_spec([Layer("submit()", values)], target=Target("module", "hpc_ddp.job.calls"),
                      workdir=os.getcwd(), python=sys.executable)


def slurm_outcome(call_dir: Path, world: int, job_id: str, state: str) -> Any:
    failures = calls.read_failures(call_dir)
    if failures:
        raise rank_error(failures, world)
    if (call_dir / calls.RESULT).exists():
        return calls.read_result(call_dir)
    raise RankError(f"job {job_id} ended {state or 'without a state'} before rank 0 returned, and no rank "
                    f"recorded an exception (killed, out of time, a node lost?); the ranks' output is in "
                    f"{call_dir.parent / 'submitit' / job_id}", rank=0, world_size=world)


# ---- what a failure says (pure) ----

def rank_error(failures: Sequence[Mapping[str, Any]], world: int, killed: Sequence[int] = ()) -> RankError:
    """The first failure in time is the cause; the ranks that failed after it are named, in one line each."""
    first, others = failures[0], list(failures[1:])
    lines = [f"rank {first['rank']} of {world} raised {first['type']}: {first['message']}",
             f"--- rank {first['rank']}'s traceback ---", first["traceback"].rstrip(), "---"]
    lines += [f"then rank {o['rank']} failed too: {o['type']}: {_first_line(o['message'])}" for o in others]
    if killed:
        lines.append(f"still running {spawn.FAILURE_GRACE_S:g} s later, killed: {_ranks(killed)}")
    return RankError("\n".join(lines), rank=int(first["rank"]), world_size=world, type=first["type"],
                     traceback=first["traceback"], others=others)


def timeout_error(ranks: Sequence[int], world: int, timeout: float | None, tails: Mapping[int, list[str]]) -> LaunchTimeout:
    lines = [f"{_ranks(ranks)} of {world} still running after timeout={timeout:g} s: killed"]
    for rank in ranks:
        if tails.get(rank):
            lines += [f"--- rank {rank}'s last output ---", *tails[rank][-5:]]
    return LaunchTimeout("\n".join(lines), ranks=ranks, world_size=world)


def died_message(rank: int, world: int, code: int, tail: Sequence[str]) -> str:
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    shown = [f"--- rank {rank}'s last output ---", *tail[-10:]] if tail else []
    return "\n".join([f"rank {rank} of {world} {how} without raising an exception", *shown])


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


# ---- checks and small edges ----

def _check_callable(fn: Any) -> None:
    if not callable(fn):
        raise UserError(f"{fn!r} is not a function", hint="pass the training function itself: launch(train, ...)")


def _check_timeout(timeout: Any) -> None:
    """None, or a number of seconds above 0 (NaN would never time out; a string is a mistake)."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or not math.isfinite(timeout) \
            or timeout <= 0:
        raise UserError(f"timeout={timeout!r}: give the seconds the ranks may run, a number above 0",
                        hint="e.g. timeout=600, or timeout=None for no limit")


def _checked_env(env: Any) -> dict[str, str]:
    """The ranks' extra variables: names to strings, as a process environment holds them."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise UserError(f"env={env!r}: give a dict of variable names to values", hint="e.g. env={'NCCL_DEBUG': 'INFO'}")
    for name, value in env.items():
        if not isinstance(name, str) or not name or "=" in name or "\0" in name:
            raise UserError(f"env: {name!r} is not a variable name", hint="names are strings such as 'NCCL_DEBUG'")
        if not isinstance(value, str) or "\0" in value:
            fix = f"env={{{name!r}: {str(value).replace(chr(0), '')!r}}}"
            raise UserError(f"env[{name!r}]={value!r}: a variable's value is a string", hint=f"write {fix}")
    return dict(env)


@contextlib.contextmanager
def _removed_on_failure(path: Path):
    """If the block raises, remove what it created at `path`: the folder itself and the missing folders
    above it (only while empty), or, in a folder that was there, the entries that were not."""
    made = []
    folder = path
    while not os.path.lexists(folder):
        made.append(folder)
        folder = folder.parent
    before = None if made else set(os.listdir(path))
    try:
        yield
    except BaseException:
        if made:
            shutil.rmtree(path, ignore_errors=True)
            for parent in made[1:]:
                with contextlib.suppress(OSError):
                    parent.rmdir()
        else:
            for name in set(os.listdir(path)) - before:
                entry = path / name
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        raise


def _check_gpus_here(gpus: int, cuda_visible: str | None) -> None:
    from hpc_ddp.launch.executors import visible_gpus

    here = visible_gpus(physical_gpus(), cuda_visible)
    if gpus > here:
        raise SpecError(f"gpus={gpus}: this machine shows {here} GPU(s)",
                        hint=f"use gpus={here} or fewer, gpus=0 (gloo on the CPU), or submit() to a cluster")


def _job_name(fn: Callable) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", getattr(fn, "__name__", "call")).strip("_") or "call"


def _pickle_call(call_dir: Path, fn: Callable, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        shown = (f"of type {type(kwargs).__name__}" if not isinstance(kwargs, Mapping) else
                 "a mapping with keys that are not names")
        raise UserError(f"kwargs= is {shown}: it is the function's keyword arguments, a dict of names to values",
                        hint="e.g. kwargs={'lr': 0.1}, or pass them after the function's positional arguments")
    try:
        calls.write_call(call_dir, fn, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever cloudpickle could not send: the user's to change
        raise UserError(f"the function or its arguments cannot be sent to the ranks: {type(exc).__name__}: {exc}",
                        hint="create such objects (open files, locks, CUDA tensors, clients) inside the function") \
            from None


def _own_run_dir(path: str | os.PathLike) -> str:
    from hpc_ddp.launch.rundirs import usable_run_dir

    made = Path(usable_run_dir(Path(path).expanduser()))
    made.mkdir(parents=True, exist_ok=True, mode=0o700)
    return str(made)
