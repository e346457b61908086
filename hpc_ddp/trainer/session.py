"""The public API for a training loop of your own: a preemption-safe, exactly resumable DDP run.

    import hpc_ddp

    with hpc_ddp.start() as run:                     # ranks meet (missing ones named), process group, device
        model = DDP(Net().to(run.device), device_ids=run.device_ids)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sampler = run.sampler(train_set, batch_size=64)   # this rank's share; resumes mid-epoch
        loader = DataLoader(train_set, batch_size=64, sampler=sampler)
        run.track(model=model, optimizer=opt)       # what a checkpoint holds (anything with state_dict)
        run.resume()                                # the newest checkpoint that verifies, if any
        for epoch in run.epochs(10):
            for x, y in loader:
                loss = F.cross_entropy(model(x.to(run.device)), y.to(run.device))
                opt.zero_grad()
                loss.backward()
                opt.step()
                run.step(loss)                      # all ranks agree on a stop: checkpoint, exit 75
        run.finish()                                # the final checkpoint and a "finish" record

What it promises, on every rank of every attempt:
- a stop request (the warning signal, SIGTERM, the job's own end time coming near) is acted on at a step
  boundary that all ranks agree on: one checkpoint, then exit 75 ("checkpointed, requeue me"), which the
  batch script's requeue policy turns into the next attempt;
- checkpoints are crash-safe (`checkpoint.CheckpointManager`): a kill at any moment leaves the old or the
  new one; loading verifies every file and falls back to the previous one;
- periodic checkpoints do not stall the loop (`async_checkpoint=True`, the default): rank 0 copies the
  state to host memory and a background thread writes it, as crash-safely (`asyncsave`). One write at a
  time; a stop and `finish()` wait until it is durable before they save, exit 75 or return; a failed
  write raises on the next `step()`. Explicit `save()` calls still return only once durable;
- on GPUs the loop never waits for the step it just queued: each step's flags are read one step late
  (`lagged`); a checkpoint due, `settle()` (before an evaluation), `finish()` and a stop read them at once;
- a resumed run continues from the same sample with the same random streams on every rank
  (`rngstate`, `data.ResumableSampler`), so it ends as an uninterrupted one would; on another number of
  ranks (a node range) with the same global batch and sample stream, unevenly split where the size does not
  divide it (`run.batch_size()`, `run.loss_weight()`, data.elastic);
- `checkpoint_every_minutes="auto"`: Young's interval from the measured save cost and the interruption
  rate (`interval`), recorded as a `checkpoint_interval` event;
- records in the run dir (`events.jsonl`, `metrics.jsonl`), so `hpc-ddp status`, `plot` and `inspect`
  work as for the built-in trainer, which is itself built on this class (`train.Trainer`).

Misuse ends with one `UsageError` line that names the fix, before anything on disk changes: `save()`
called on some ranks only (or `finish()` on others), a checkpoint from another world size, batch size or
model, state that holds code, counts below 1, `track()` after `resume()`, `step()` after `finish()`, a
second `start()`. An error on one rank is its one line; the other ranks each say in one line that it left.

Session is one class in three files: here joining and leaving (setup, device, close); `sessionsave.py` what
a checkpoint holds, saving and resuming; `sessionstep.py` the loop (samplers, epochs, step, records, the
stall watch's view) and stopping. Their errors and Progress are in `sessionbase.py`, re-exported here.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.common.errors import HpcDdpError, report
from hpc_ddp.common.events import JsonLines
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE
from hpc_ddp.common.procs import exit_after_handlers
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.data.elastic import Split
from hpc_ddp.data.loaders import ResumableSampler, shield_loader_workers
from hpc_ddp.job.deadline import job_deadline
from hpc_ddp.job.distenv import DistEnv, from_environ
from hpc_ddp.job.gpubind import own_device
from hpc_ddp.trainer import rendezvous
from hpc_ddp.trainer.asyncsave import BackgroundWriter, Snapshot, Snapshotter
from hpc_ddp.trainer.checkpoint import CheckpointManager
from hpc_ddp.trainer.interval import AUTO
from hpc_ddp.trainer.lagged import LaggedFlags
from hpc_ddp.trainer.loggers import Loggers, check_names
from hpc_ddp.trainer.sessionbase import Diverged, IncompatibleResume, Progress, UsageError
from hpc_ddp.trainer.sessionsave import SaveAndResume
from hpc_ddp.trainer.sessionstep import StepAndStop
from hpc_ddp.trainer.settings import check_settings, count_setting
from hpc_ddp.trainer.stallwatch import STORE_ANSWER_S, StallWatch
from hpc_ddp.trainer.stopping import StopFlag
from hpc_ddp.trainer.writerlock import WriterLock

__all__ = ["Session", "start", "Progress", "UsageError", "IncompatibleResume", "Diverged"]


def start(run_dir: str | os.PathLike | None = None, **settings: Any) -> "Session":
    """Make this process one rank of the run and return its Session (see the module docstring).
    `run_dir` defaults to the run dir hpc-ddp gave this rank ($HPC_DDP_RUN_DIR)."""
    _one_line_errors()  # a misuse found from here on (no run dir, a file as one) is one line, not a traceback
    if _ACTIVE and not _ACTIVE[0]._closed:
        raise UsageError(f"hpc_ddp.start() was already called in this process (rank {_ACTIVE[0].rank} of "
                         f"{_ACTIVE[0].world_size}): one process is one rank of one run",
                         hint="use the run the first start() returned, or close it (leave its `with` block) "
                              "before starting another")
    return Session(run_dir, **check_settings(settings)).setup()


_ACTIVE: list["Session"] = []   # the session start() made in this process, while it is open


class Session(StepAndStop, SaveAndResume):
    """One rank's handle on a preemption-safe run. Build it with `hpc_ddp.start()`."""

    # A loop may change these mid-run (run.checkpoint_every_steps = 100): checked as start() checks them.
    @property
    def checkpoint_every_steps(self) -> int:
        return self._checkpoint_every_steps

    @checkpoint_every_steps.setter
    def checkpoint_every_steps(self, value: int) -> None:
        self._checkpoint_every_steps = count_setting("checkpoint_every_steps", value, 0)

    @property
    def log_every(self) -> int:
        return self._log_every

    @log_every.setter
    def log_every(self, value: int) -> None:
        self._log_every = count_setting("log_every", value, 1)

    def __init__(self, run_dir: str | os.PathLike | None = None, *, checkpoint_every_steps: int = 0,
                 checkpoint_every_minutes: float | str = 30.0, keep: int = 3, log_every: int = 10,
                 fingerprint: Mapping[str, Any] | None = None, stop_lead_seconds: float = 0.0,
                 stop_on_nonfinite: bool = True, exit_on_stop: bool = True, env: DistEnv | None = None,
                 async_checkpoint: bool = True, loggers: tuple[str, ...] | list[str] = ()):
        self.run_dir = _run_dir(run_dir)
        spec = _spec_in(self.run_dir)
        self.env = env or from_environ(os.environ, pid=os.getpid())
        self.rendezvous_timeout = _setting(spec, "rendezvous_timeout", "HPC_DDP_RENDEZVOUS_TIMEOUT", 300.0)
        self.collective_timeout = _setting(spec, "collective_timeout", "HPC_DDP_COLLECTIVE_TIMEOUT", 600.0)
        self.signal_lead = float(getattr(spec, "signal_lead", 120))
        self.gpus_asked = int(getattr(spec, "gpus", 0) or 0)
        self.stop = StopFlag((getattr(spec, "signal", "USR2"), "TERM"))
        # "auto": Young's interval from the measured save cost and the interruption rate (interval.py), chosen
        # by rank 0 at setup and again when the first save is measured and sacct answers.
        if isinstance(checkpoint_every_minutes, str) and checkpoint_every_minutes != AUTO:
            raise UsageError(f"checkpoint_every_minutes={checkpoint_every_minutes!r} is neither minutes nor \"auto\"",
                             hint="pass a number of minutes (0: none), or \"auto\"")
        self.auto_interval = checkpoint_every_minutes == AUTO
        self.checkpoint_every_steps = checkpoint_every_steps
        self.checkpoint_every_minutes = 0.0 if self.auto_interval else float(checkpoint_every_minutes)
        self._interval_inputs: dict[str, Any] = {}   # auto: the evidence and save cost the interval was chosen from
        self._interval_dirty = False
        self.log_every, self.stop_lead_seconds = log_every, stop_lead_seconds
        self.stop_on_nonfinite, self.exit_on_stop = stop_on_nonfinite, exit_on_stop
        self.fingerprint = {**(fingerprint or {}), "world_size": self.env.world_size}
        # A node range (--nodes MIN-MAX) lets a resume run on another world size; a fixed size refuses one.
        self.elastic: str | None = getattr(spec, "elastic", None) if getattr(spec, "nodes_max", None) else None
        self._accum: int | None = None        # the accumulation `accumulation()` gave; saved in checkpoints
        self._busy, self._attempt_steps = 0, 0  # the stall watch: paused while busy; armed after a few steps
        self._watch_stalls = getattr(spec, "debug_rank", None) is None  # a rank at a breakpoint is no hang
        self.stallwatch: StallWatch | None = None
        self._asking: threading.Thread | None = None   # a stall check's question to the store, in flight
        self._own_group = False   # a world of one: the process group setup() made for it, destroyed by close()
        self._batch_size: int | None = None
        self._split: Split | None = None      # how the ranks share each step's global batch (data.elastic)
        self._finished = False
        self._writer_lock: WriterLock | None = None  # rank 0's, while it writes the run dir (writerlock.py)
        self._resume_called = False
        self._batch_asked = False             # batch_size() was asked: the loop's loaders follow an uneven split
        self._loaders: list[Any] = []         # the DataLoaders loader() made (their batch follows the split)
        self.progress = Progress()
        self.total_steps: int | None = None
        self.epochs_total: int | None = None
        self.checkpoints = CheckpointManager(RunDir(self.run_dir).checkpoints, keep=keep, log=self.log)
        # Periodic saves snapshot to host memory and write in the background (asyncsave.py); rank 0 only.
        self.async_checkpoint = async_checkpoint
        self._writer = BackgroundWriter(log=self.log) if async_checkpoint else None
        self._snapshots = Snapshotter()
        self._in_flight: Snapshot | None = None
        self.events = JsonLines(RunDir(self.run_dir).events, enabled=self.is_main)
        self.metrics = JsonLines(RunDir(self.run_dir).metrics, enabled=self.is_main)
        # TensorBoard / W&B (loggers.py): fed what metrics.jsonl gets, by rank 0.
        names = check_names(loggers)  # on every rank: a typo stops each at its start
        self.loggers = Loggers(names if self.is_main else (), self.run_dir, log=self.log)
        self.device = torch.device("cpu")
        self.store: Any = None
        self.heartbeat: rendezvous.Heartbeat | None = None
        self.deadline: float | None = None
        self.started = time.time()
        self.step_seconds: float | None = None
        self.save_seconds: float | None = None
        self.last_save = time.monotonic()
        self._stop_read = False  # a stop agreed in flags read by a save(), for the next step() to act on
        self._due_sent = False   # rank 0 sent "checkpoint due" (by its clock) and no save has happened since
        self._tracked: dict[str, Any] = {}
        self._samplers: list[tuple[ResumableSampler, int, tuple | None]] = []
        self._sent: torch.Tensor | None = None
        self._lag = LaggedFlags()
        self._lag_on_cpu = False   # tests: the GPU's one-step-late reading, on CPU tensors
        self._window = (time.monotonic(), 0, 0)   # (when, step, samples) of the last record
        self._step_started = time.monotonic()
        self._saves = 0
        self._bar_open = False
        self._closed = False

    # ---- who and where ----

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def distributed(self) -> bool:
        return self.env.world_size > 1

    @property
    def device_ids(self) -> list[int] | None:
        """What DDP's `device_ids` wants: [this rank's GPU], or None on CPU."""
        return [self.device.index] if self.device.type == "cuda" else None

    def log(self, message: str) -> None:
        """A line on rank 0's stderr (after the progress line, if one is open)."""
        if self.is_main:
            if self._bar_open:
                print(file=sys.stdout, flush=True)
                self._bar_open = False
            print(message, file=sys.stderr, flush=True)

    # ---- joining and leaving ----

    def setup(self) -> "Session":
        """Install the stop signals, pick the device, meet the other ranks (bounded, naming the missing
        ones), build the process group and check it with one all-reduce. Called by `start()`."""
        _stall_floor()   # a bad HPC_DDP_STALL_MIN_S is one line now, not a ValueError on every rank later
        if self.is_main:
            self._writer_lock = WriterLock(str(self.run_dir))
            holder = self._writer_lock.acquire()
            if holder is not None:
                raise UsageError(
                    f"another process{f' (pid {holder})' if holder else ''} on this node is rank 0 of the run in "
                    f"{self.run_dir} already: two writers would interleave its checkpoints and records",
                    hint="one hpc_ddp.start() per rank: a script's own mp.spawn children that each call it under "
                         "one task all become rank 0 of 1; drop mp.spawn and let hpc-ddp start one task per GPU "
                         "(--tasks-per-node), or give each run its own --run-dir")
        self.stop.install()
        shield_loader_workers()
        backend = self._pick_device()
        if self.distributed:
            if dist.is_initialized():  # its store holds MASTER_PORT: ours would be told the port is in use
                raise UsageError("the script made its own process group (dist.init_process_group) before "
                                 "hpc_ddp.start(), which makes the group itself",
                                 hint="remove the script's own init_process_group: start() builds the default "
                                      "group, and dist.get_rank() and the collectives work after it")
            _fault_before_join(self.env)
            self.store = rendezvous.join(self.env, timeout_s=self.rendezvous_timeout)
            group = dict(backend=backend, store=dist.PrefixStore("pg", self.store), rank=self.rank,
                         world_size=self.world_size, timeout=timedelta(seconds=self.collective_timeout))
            rendezvous.health_check(self.store, self.env, self.device, timeout_s=self.rendezvous_timeout,
                                    connect=lambda: dist.init_process_group(**group))
            self.heartbeat = rendezvous.Heartbeat(self.env, on_failed_peer=self._peer_failed).start()
            if self._watch_stalls and os.environ.get("HPC_DDP_STALL_MIN_S") != "off":
                self.stallwatch = StallWatch(self, self._stalled, cap_s=self.collective_timeout).start()
        elif not dist.is_initialized():
            # One rank is a world of one: DDP (and any collective) wants a process group there too (issue 42),
            # so a script written for N ranks runs unchanged on 1. Nothing to meet: a store of its own.
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        if not self.distributed and self._watch_stalls and os.environ.get("HPC_DDP_STALL_MIN_S") != "off":
            # One rank has no peer to hold up, but a hang (a deadlock, a filesystem or data loader that never
            # answers) holds its GPU until the time limit all the same: watched as on N ranks.
            self.stallwatch = StallWatch(self, self._stalled, cap_s=None).start()
        self.deadline = job_deadline(os.environ) if self.is_main else None
        if self.auto_interval and self.is_main:
            self._start_interval()
        atexit.register(self.close)  # a script that never leaves a `with` block still leaves cleanly
        _one_line_errors()
        _ACTIVE[:] = [self]
        return self

    def _pick_device(self) -> str:
        backend = os.environ.get("BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl" and torch.cuda.is_available():
            # The runner's binding (job/gpubind.py) says which visible GPU is this rank's own: LOCAL_RANK
            # where the rank sees the node's GPUs, 0 where it sees only its own.
            self.device = torch.device("cuda", own_device(os.environ, torch.cuda.device_count()))
            torch.cuda.set_device(self.device)
            return "nccl"
        self.device = torch.device("cpu")
        if self.gpus_asked and torch.cuda.is_available():
            self.log(f"hpc-ddp: warning: the job asked for {self.gpus_asked} GPU(s) per node and this rank sees "
                     f"{torch.cuda.device_count()}, but BACKEND is {backend!r}: training on the CPU "
                     "(HINT: unset BACKEND and HPC_DDP_BACKEND, or set HPC_DDP_BACKEND=nccl)")
        return "gloo"

    def close(self, why: str = "finished") -> None:
        """Leave the run: say why (so survivors blame the right rank), stop the heartbeat, destroy the
        process group (bounded), give the signals back. Idempotent; `with` calls it."""
        if self._closed:
            return
        self._closed = True
        if why == "finished" and _UNCAUGHT and not isinstance(_UNCAUGHT[0], SystemExit):
            # Called at exit, after an error the script did not catch: the peers read this error (their
            # heartbeat stops them at once), not "finished", which they would wait out in a broken collective
            # until this process, which holds the group, exits; rank 0 waited for them meanwhile (issue 44).
            why = _summary(_UNCAUGHT[0])
        self._drain_writer()
        self._drain_records(why)
        self.loggers.close()
        if self.stallwatch is not None:
            self.stallwatch.stop()
        if self._asking is not None:  # a stall check asking the store: let it end before the store goes
            self._asking.join(STORE_ANSWER_S)
        rendezvous.mark_left(self.store, self.env, why)  # before the heartbeat stops: see mark_left
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if (self.distributed or self._own_group) and dist.is_initialized():
            rendezvous.leave()
        # Rank 0's store outlives the others' exits (bounded): they read why it left rather than dump C++ frames.
        rendezvous.outlive_peers(self.store, self.env, 5.0 if why == "finished" else min(15.0, self.collective_timeout))
        self.stop.uninstall()
        if self._writer_lock is not None:
            self._writer_lock.release()

    def _drain_writer(self) -> None:
        """Leaving with a background write in flight (an error, or no finish()): let it become durable,
        so the checkpoint it holds is not lost; a failure is said, not raised over the one in progress."""
        try:
            self.wait_for_checkpoint()
        except HpcDdpError as exc:
            self.log(f"hpc-ddp: error: {exc}")

    def _drain_records(self, why: str) -> None:
        """A loop that ends without finish(): its last step's record still gets written (GPU runs read it
        late), if its copy has landed. Not after an error: a stream stuck behind a failed collective
        would hold the exit, and the steps after the error are not results."""
        if why != "finished":
            self._lag.discard()
            return
        try:
            self._drain(timeout=max(5.0, 3 * (self.step_seconds or 0.0)))
        except TimeoutError:
            self.log("hpc-ddp: the last step's record was not written: its GPU work did not finish in time")
        except (HpcDdpError, RuntimeError) as exc:
            self.log(f"hpc-ddp: the last step's record was not written: {_summary(exc)}")

    def _peer_failed(self, rank: int, why: str, store: Any) -> None:
        """The heartbeat thread saw another rank leave for a failure of its own (an error on that rank):
        say it in one line and acknowledge in the store, while it is still there (rank 0 waits for that,
        outlive_peers), so this rank's own failure, when the collective it waits in breaks, ends it quietly
        instead of with c10d's C++ frame dumps about a store that is gone (issue 43)."""
        global _PEER_FAILED
        if self._closed or self._finished:
            return
        _PEER_FAILED = True
        if self.is_main:  # the store's host leaves last, quietly too: see _quiet_exit
            _STORE_HOST[:] = [self.store, self.env]
        # The same words as explain_failure's, which says it when the broken collective is seen first.
        print(f"hpc-ddp: error: rank {self.rank}: {rendezvous.describe_ranks(self.env, [rank])} failed: "
              f"{why[:200]}; stopping", file=sys.stderr, flush=True)
        rendezvous.mark_left(store, self.env, rendezvous.LEFT_AFTER_OTHERS)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, kind, exc, _tb) -> None:
        if _PEER_FAILED and exc is not None and not isinstance(exc, SystemExit):
            _quiet_exit()  # said already: another rank's error, which ended this rank's collective
        if exc is None or isinstance(exc, SystemExit):
            self.close("finished" if exc is None or exc.code in (0, REQUEUE_EXIT_CODE) else f"exit {exc.code}")
            return
        if isinstance(exc, (dist.DistError, RuntimeError)) and self.distributed:
            # A failed collective usually means a peer is gone: name it rather than show a gloo/NCCL trace.
            lost = rendezvous.explain_failure(self.store, self.env)
            if lost is not None:
                self.close(rendezvous.LEFT_AFTER_OTHERS)
                raise rendezvous.PeerLost(f"rank {self.rank}: {lost}; stopping ({_summary(exc)[:200]})",
                                          hint="see that rank's log (hpc-ddp logs JOB --rank N)") from None
        self.close(_summary(exc))


# ---- helpers ----

def _run_dir(given: str | os.PathLike | None) -> Path:
    chosen = given or os.environ.get("HPC_DDP_RUN_DIR")
    if not chosen:
        raise UsageError("no run dir: hpc_ddp.start() keeps checkpoints and records in the run dir hpc-ddp gives "
                         "each rank ($HPC_DDP_RUN_DIR)",
                         hint="launch with `hpc-ddp submit`, or pass start(run_dir=...) under torchrun")
    path = Path(chosen).resolve()
    if path.exists() and not path.is_dir():
        raise UsageError(f"run dir {path} is not a directory", hint="pass start(run_dir=...) a directory")
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def _spec_in(run_dir: Path) -> Any:
    """The job's spec where hpc-ddp wrote one (its timeouts and signal), else None."""
    from hpc_ddp.spec.jobspec import load_spec

    if not RunDir(run_dir).spec.is_file():
        return None
    try:
        return load_spec(RunDir(run_dir).spec)
    except HpcDdpError:
        return None


def _setting(spec: Any, key: str, variable: str, default: float) -> float:
    if spec is not None:
        return float(getattr(spec, key))
    try:
        return float(os.environ.get(variable) or default)
    except ValueError:
        return default


def _stall_floor() -> None:
    """HPC_DDP_STALL_MIN_S: seconds (the stall watch's floor) or "off"; anything else is refused here."""
    raw = os.environ.get("HPC_DDP_STALL_MIN_S")
    if raw is None or raw == "" or raw == "off":
        return
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise UsageError(f"HPC_DDP_STALL_MIN_S={raw!r} is not a number of seconds or \"off\"",
                         hint="set HPC_DDP_STALL_MIN_S=300 (seconds, no unit), or off to turn the stall watch off")


def _fault_before_join(env: DistEnv) -> None:
    """HPC_DDP_FAULT_NO_JOIN=R: rank R hangs before the rendezvous (a rank that never starts: no stop
    flag of ours yet, so a SIGTERM ends it as it would a process still starting up)."""
    if os.environ.get("HPC_DDP_FAULT_NO_JOIN") == str(env.rank):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(10**6)


_PEER_FAILED = False   # another rank left for an error of its own: this rank's own error that follows is its echo


_STORE_HOST: list[Any] = []   # rank 0's (store, env) once it knows of another rank's failure
_UNCAUGHT: list[BaseException] = []  # the exception that ends the program (the exit handlers run after it)


def _quiet_exit() -> None:
    """Leave at once with 1, without the destructors and threads that would talk to a store that is gone;
    rank 0, which holds the store, first waits (bounded) until every rank has said it left."""
    if _STORE_HOST:
        rendezvous.outlive_peers(*_STORE_HOST, 5.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _one_line_errors() -> None:
    """An hpc-ddp error a user's script does not catch (misuse, a refused resume) prints as one line with
    its hint and exits with its code, as the CLI's do; any other exception keeps its traceback."""
    previous = sys.excepthook
    if getattr(previous, "_hpc_ddp", False):
        return

    def hook(kind, exc, tb):
        _UNCAUGHT[:] = [exc]
        if _PEER_FAILED and not isinstance(exc, SystemExit):
            _quiet_exit()
        if isinstance(exc, HpcDdpError):
            exit_after_handlers(report(exc))  # the error's code (2 for misuse), which only _exit sets here
        previous(kind, exc, tb)
    hook._hpc_ddp = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _summary(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
