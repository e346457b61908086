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
  (`rngstate`, `data.ResumableSampler`), so it ends as an uninterrupted one would;
- records in the run dir (`events.jsonl`, `metrics.jsonl`), so `hpc-ddp status`, `plot` and `inspect`
  work as for the built-in trainer, which is itself built on this class (`train.Trainer`).

Misuse ends with one `UsageError` line that names the fix, before anything on disk changes: `save()`
called on some ranks only, a checkpoint from another world size, state that holds code.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from hpc_ddp.common.errors import HpcDdpError, UserError, report
from hpc_ddp.common.events import JsonLines
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE
from hpc_ddp.common.procs import exit_after_handlers
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.data.elastic import Resized, resize
from hpc_ddp.data.loaders import ResumableSampler, SeededSamples, shield_loader_workers, worker_init, worker_niceness
from hpc_ddp.job.deadline import job_deadline, stop_lead
from hpc_ddp.job.distenv import DistEnv, from_environ
from hpc_ddp.job.gpubind import own_device
from hpc_ddp.trainer import rendezvous
from hpc_ddp.trainer.asyncsave import BackgroundWriter, Snapshot, Snapshotter
from hpc_ddp.trainer.checkpoint import CheckpointManager, Loaded, state_sha256
from hpc_ddp.trainer.lagged import LaggedFlags
from hpc_ddp.trainer.loggers import Loggers
from hpc_ddp.trainer.rngstate import capture_rng, restore_rng
from hpc_ddp.trainer.stallwatch import FACTOR, STALL_EXIT_CODE, STORE_ANSWER_S, StallWatch
from hpc_ddp.trainer.stopping import StopFlag

__all__ = ["Session", "start", "Progress", "UsageError", "IncompatibleResume", "Diverged"]

SESSION_FILE = "session.pt"   # progress + every rank's RNG streams, next to the tracked states


class UsageError(UserError):
    """The API was called in a way that cannot work; the message names the fix."""


class IncompatibleResume(UserError):
    """The checkpoint was made by a run this one differs from (world size, settings, schedule)."""


class Diverged(HpcDdpError):
    """The loss became NaN or infinite: stop without a checkpoint and without a requeue (exit 1)."""


@dataclasses.dataclass
class Progress:
    step: int = 0               # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0     # batches of this epoch already consumed, per rank
    restarts: int = 0           # resumes from a checkpoint so far
    samples: int = 0            # samples consumed, all ranks together (where step() is told)


@dataclasses.dataclass(frozen=True)
class _Done:
    """A completed step, as its record will say (written when its flags are read: one step late on GPUs)."""
    step: int
    epoch: int
    when: float       # time.monotonic() at its step()
    samples: int
    has_loss: bool


def start(run_dir: str | os.PathLike | None = None, **settings: Any) -> "Session":
    """Make this process one rank of the run and return its Session (see the module docstring).
    `run_dir` defaults to the run dir hpc-ddp gave this rank ($HPC_DDP_RUN_DIR)."""
    return Session(run_dir, **settings).setup()


class Session:
    """One rank's handle on a preemption-safe run. Build it with `hpc_ddp.start()`."""

    def __init__(self, run_dir: str | os.PathLike | None = None, *, checkpoint_every_steps: int = 0,
                 checkpoint_every_minutes: float = 30.0, keep: int = 3, log_every: int = 10,
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
        self.checkpoint_every_steps, self.checkpoint_every_minutes = checkpoint_every_steps, checkpoint_every_minutes
        self.log_every, self.stop_lead_seconds = max(1, log_every), stop_lead_seconds
        self.stop_on_nonfinite, self.exit_on_stop = stop_on_nonfinite, exit_on_stop
        self.fingerprint = {**(fingerprint or {}), "world_size": self.env.world_size}
        # A node range (--nodes MIN-MAX) lets a resume run on another world size; a fixed size refuses one.
        self.elastic: str | None = getattr(spec, "elastic", None) if getattr(spec, "nodes_max", None) else None
        self._accum: int | None = None        # the accumulation `accumulation()` gave; saved in checkpoints
        self._busy, self._attempt_steps = 0, 0  # the stall watch: paused while busy; armed after a few steps
        self._watch_stalls = getattr(spec, "debug_rank", None) is None  # a rank at a breakpoint is no hang
        self.stallwatch: StallWatch | None = None
        self._batch_size: int | None = None
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
        self.loggers = Loggers(loggers if self.is_main else (), self.run_dir, log=self.log)
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
        self.stop.install()
        shield_loader_workers()
        backend = self._pick_device()
        if self.distributed:
            _fault_before_join(self.env)
            self.store = rendezvous.join(self.env, timeout_s=self.rendezvous_timeout)
            group = dict(backend=backend, store=dist.PrefixStore("pg", self.store), rank=self.rank,
                         world_size=self.world_size, timeout=timedelta(seconds=self.collective_timeout))
            rendezvous.health_check(self.store, self.env, self.device, timeout_s=self.rendezvous_timeout,
                                    connect=lambda: dist.init_process_group(**group))
            self.heartbeat = rendezvous.Heartbeat(self.env).start()
            if self._watch_stalls and os.environ.get("HPC_DDP_STALL_MIN_S") != "off":
                self.stallwatch = StallWatch(self, self._stalled, cap_s=self.collective_timeout).start()
        self.deadline = job_deadline(os.environ) if self.is_main else None
        atexit.register(self.close)  # a script that never leaves a `with` block still leaves cleanly
        _one_line_errors()
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
        self._drain_writer()
        self._drain_records(why)
        self.loggers.close()
        if self.stallwatch is not None:
            self.stallwatch.stop()
        rendezvous.mark_left(self.store, self.env, why)  # before the heartbeat stops: see mark_left
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.distributed and dist.is_initialized():
            rendezvous.leave()
        self.stop.uninstall()

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

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, kind, exc, _tb) -> None:
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

    # ---- what a checkpoint holds ----

    def track(self, **objects: Any) -> None:
        """Name the states a checkpoint holds: modules (a DDP wrapper is unwrapped), optimizers,
        schedulers, scalers, anything with state_dict()/load_state_dict(), or a plain dict (updated in
        place on resume). `model=` is the one `hpc-ddp inspect` hashes."""
        for name, obj in objects.items():
            if not name.isidentifier() or f"{name}.pt" == SESSION_FILE:
                raise UsageError(f"track(): {name!r} cannot name a checkpoint file",
                                 hint="use a plain identifier other than 'session'")
            if not (isinstance(obj, dict) or hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise UsageError(f"track(): {name}={type(obj).__name__} has no state_dict()/load_state_dict()",
                                 hint="track modules, optimizers, schedulers, or a dict of tensors and numbers")
            self._tracked[name] = obj

    def save(self, reason: str = "periodic", *, wait: bool = True) -> Path | None:
        """Write a checkpoint of the tracked states, progress and every rank's RNG. Collective: every rank
        calls it at the same point (rank 0 writes). By default it returns once the checkpoint is durable
        (its path on rank 0, None elsewhere). With `wait=False` and async checkpoints on (the default;
        what `step()` does for periodic saves), rank 0 snapshots the state to host memory, a background
        thread writes it (just as crash-safe), and every rank returns None at once; the next save, a stop
        and `finish()` wait for it, and a failed write raises on the next `step()` or `save()`."""
        with self.busy("saving a checkpoint"):
            return self._save(reason, wait)

    def _save(self, reason: str, wait: bool) -> Path | None:
        started = time.monotonic()
        self._check_writer()
        self._drain()  # GPU: the last step's flags first: a NaN in them is never checkpointed
        self._all_arrive("save")
        rng = [capture_rng()]
        if self.distributed:
            rng = [None] * self.world_size
            dist.all_gather_object(rng, capture_rng())
        background = not wait and self._writer is not None
        path = None
        if self.is_main:
            payloads = {f"{name}.pt": _state_of(obj) for name, obj in self._tracked.items()}
            payloads[SESSION_FILE] = {"progress": dataclasses.asdict(self.progress), "rng": rng}
            for fname, payload in payloads.items():
                _check_plain(payload, fname.removesuffix(".pt"))
            if background:
                self._save_in_background(payloads, reason, started)
            else:
                path = self._save_now(payloads, reason, started)
        if self.distributed and not background:
            dist.barrier()  # nobody exits or goes on before the checkpoint is durable
        self.last_save, self._due_sent = time.monotonic(), False
        return path

    def _save_now(self, payloads: dict[str, Any], reason: str, started: float) -> Path:
        """Rank 0: wait for the write in flight (at most one at a time), then write this one and return
        once it is durable."""
        self.wait_for_checkpoint()
        path = self.checkpoints.save(self.progress.step, payloads, self._meta(payloads, reason))
        self._saved(path, reason, self.progress.step, self.progress.epoch, time.monotonic() - started)
        return path

    def _save_in_background(self, payloads: dict[str, Any], reason: str, started: float) -> None:
        """Rank 0: snapshot to host memory, hand the write to the background thread, return."""
        self.wait_for_checkpoint()  # at most one in flight; raises if it failed
        if self._in_flight is not None:  # written: its host buffers serve this snapshot
            self._snapshots.recycle(self._in_flight)
        snapshot = self._in_flight = self._snapshots.take(payloads)
        step, epoch = self.progress.step, self.progress.epoch
        meta = self._meta(snapshot.payloads, reason, model_hash=False)
        blocked = time.monotonic() - started

        def write() -> Path:
            state = snapshot.ready()
            if "model.pt" in state:  # hashed here, off the loop
                meta["model_sha256"] = state_sha256(state["model.pt"])
            return self.checkpoints.save(step, state, meta)

        self._writer.start(write, done=lambda path, seconds: self._saved(
            path, reason, step, epoch, blocked + seconds, blocked=blocked))

    def _saved(self, path: Path, reason: str, step: int, epoch: int, seconds: float,
               blocked: float | None = None) -> None:
        """The "checkpoint" record, once a checkpoint is durable (on the writer thread for background
        saves). `seconds` is snapshot to durable: what a stop's save costs, so the stop lead uses it."""
        self.save_seconds = seconds
        record = {"event": "checkpoint", "step": step, "epoch": epoch, "reason": reason, "path": str(path),
                  "seconds": round(seconds, 3)}
        if blocked is not None:
            record.update({"background": True, "blocked_s": round(blocked, 3)})
        self.events.write(record)

    def wait_for_checkpoint(self) -> Path | None:
        """Block until the background checkpoint write in flight (if any) is durable and return its path
        (rank 0; None elsewhere or when none was in flight). Raises CheckpointError if it failed."""
        return self._writer.wait() if self._writer is not None else None

    def _check_writer(self) -> None:
        """A background write that failed raises here, on the loop's thread: never silently."""
        if self._writer is not None:
            self._writer.check()

    def _meta(self, payloads: Mapping[str, Any], reason: str, model_hash: bool = True) -> dict[str, Any]:
        meta = {"epoch": self.progress.epoch, "batch_in_epoch": self.progress.batch_in_epoch, "reason": reason,
                "fingerprint": self.fingerprint}
        if os.environ.get("HPC_DDP_CODE_ID"):  # the code snapshot that made it (`hpc-ddp inspect` shows it)
            meta["code"] = os.environ["HPC_DDP_CODE_ID"]
        if self._accum is not None:  # what a resume on another world size starts from (data.elastic)
            meta["grad_accum"] = self._accum
        if model_hash and "model.pt" in payloads:
            meta["model_sha256"] = state_sha256(payloads["model.pt"])
        return meta

    def _all_arrive(self, what: str) -> None:
        """Every rank must reach this call: name those that do not, instead of hanging in a collective
        until its timeout (the usual mistake: `if rank == 0: run.save()`)."""
        if not self.distributed or self.store is None:
            return
        self._saves += 1
        missing = rendezvous.wait_for_all(self.store, self.env, f"{what}/{self._saves}", self.collective_timeout)
        if missing:
            raise UsageError(
                f"{what}() is collective, but {rendezvous.describe_ranks(self.env, missing)} did not call it "
                f"within {self.collective_timeout:g} s (rank {self.rank} did)",
                hint=f"call run.{what}() on every rank; rank 0 alone writes the checkpoint")

    def resume(self, total_steps: int | None = None) -> bool:
        """Load the newest checkpoint that verifies into the tracked states, restore progress and this
        rank's RNG; False (and a "start" record) when there is none. `total_steps` is the run's length:
        `status` shows progress against it, and a checkpoint beyond it is refused (BeyondSchedule)."""
        self.total_steps = total_steps or self.total_steps
        loaded = self.checkpoints.load_latest(max_step=self.total_steps)  # one beyond the schedule: refused
        if loaded is None:
            self.events.write({"event": "start", "step": 0, "total_steps": self.total_steps,
                               "world_size": self.world_size, "job_id": self.env.job_id, "device": str(self.device)})
            return False
        self._check_compatible(loaded)
        missing = [name for name in self._tracked if f"{name}.pt" not in loaded.payloads]
        if missing or SESSION_FILE not in loaded.payloads:
            held = sorted(f.removesuffix(".pt") for f in loaded.payloads)
            raise IncompatibleResume(f"cannot resume from {loaded.path}: it holds {held}, not {missing or ['session']}",
                                     hint="track() the same names as the run that saved it, or use another --run-dir")
        for name, obj in self._tracked.items():
            _load_into(obj, loaded.payloads[f"{name}.pt"])
        session = loaded.payloads[SESSION_FILE]
        self.progress = Progress(**session["progress"])
        self.progress.restarts += 1
        saved_world = len(session["rng"])
        if saved_world != self.world_size:
            self._resume_resized(saved_world, _saved_accum(loaded.manifest))
        if self.rank < saved_world:
            restore_rng(session["rng"][self.rank])
        # epochs counted from 1, as the step lines count them ("epoch 2/3"); the records keep the index
        self.log(f"hpc-ddp: resumed from {loaded.path} (step {self.progress.step}, epoch {self.progress.epoch + 1}, "
                 f"batch {self.progress.batch_in_epoch} of the epoch)")
        self.events.write({"event": "resume", "step": self.progress.step, "epoch": self.progress.epoch,
                           "batch_in_epoch": self.progress.batch_in_epoch, "path": str(loaded.path),
                           "restarts": self.progress.restarts, "device": str(self.device)})
        self._window = (time.monotonic(), self.progress.step, self.progress.samples)
        return True

    def accumulation(self, grad_accum: int = 1, *, batch_size: int) -> int:
        """The micro-batches per optimizer step from now on: `grad_accum`, unless this run resumes on another
        world size than the checkpoint's and keeps the global batch (`elastic = "keep_global_batch"`, a node
        range's default): then as many more or fewer as keep batch x ranks x accumulation the same. Ask it
        before the loop's schedule is built (the steps per epoch follow from it)."""
        manifest = self.checkpoints.latest_manifest()
        saved, used = _saved_world(manifest), _saved_accum(manifest)
        self._batch_size = batch_size
        if saved is None:
            self._accum = grad_accum
        elif saved == self.world_size:
            self._accum = used or grad_accum  # a run resized before goes on with the accumulation it had
        else:
            self._accum = self._resize(saved, batch_size, used or grad_accum, batch_in_epoch=0).grad_accum
        return self._accum

    def _resize(self, saved: int, batch_size: int, grad_accum: int, batch_in_epoch: int) -> Resized:
        if self.elastic is None:
            raise IncompatibleResume(
                f"cannot resume: the checkpoint was saved by {saved} ranks, this run has {self.world_size} (a fixed "
                "number of nodes: each rank's data order and random streams are in it)",
                hint=f"resume with the same nodes x GPUs ({saved} ranks), or submit with --nodes MIN-MAX (a range) "
                     "to let a run resume on another size")
        try:
            return resize(saved_world=saved, world=self.world_size, batch_size=batch_size, grad_accum=grad_accum,
                          batch_in_epoch=batch_in_epoch, policy=self.elastic)
        except ValueError as exc:
            raise IncompatibleResume(f"cannot resume on {self.world_size} ranks: {exc}",
                                     hint="resume on a number of nodes the global batch divides, or set "
                                          "--elastic keep_per_rank_batch") from None

    def _check_compatible(self, loaded: Loaded) -> None:
        saved = loaded.manifest.get("fingerprint") or {}
        if saved.get("world_size") not in (None, self.world_size) and self.elastic is None:
            self._resize(int(saved["world_size"]), 1, 1, 0)  # refused, naming the range option
        changed = [f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in self.fingerprint.items()
                   if saved.get(k) != v and not (k == "world_size" and self.elastic)]
        if changed:
            raise IncompatibleResume(f"cannot resume from {loaded.path}: the run changed {'; '.join(changed)}",
                                     hint="restore those settings, or start afresh with another --run-dir")

    def _resume_resized(self, saved_world: int, saved_accum: int | None) -> None:
        """Go on at this world size from where `saved_world` ranks stopped: the same global position in the
        epoch's order (data.elastic). The batch size is the one `accumulation()` was told, else the first
        followed sampler's; the saved run's accumulation is in its checkpoint (1 where it was never asked)."""
        batch_size = self._batch_size or (self._samplers[0][1] if self._samplers else 1)
        moved = self._resize(saved_world, batch_size, saved_accum or 1, self.progress.batch_in_epoch)
        if self._accum is not None and moved.grad_accum != self._accum:
            raise IncompatibleResume(f"the checkpoint resumed is not the one the run planned with (accumulation "
                                     f"{self._accum}, this one needs {moved.grad_accum})",
                                     hint="resubmit: the next attempt plans with the checkpoint it finds")
        self._accum = moved.grad_accum
        self.progress.batch_in_epoch = moved.batch_in_epoch
        fresh = f"; ranks {saved_world}-{self.world_size - 1} had no random streams in the checkpoint and start from " \
                "their seeds" if self.world_size > saved_world else ""
        self.log(f"hpc-ddp: {moved.note}{fresh}")
        self.events.write({"event": "resized", "from_world_size": saved_world, "world_size": self.world_size,
                           "grad_accum": moved.grad_accum, "global_batch": moved.global_batch,
                           "policy": self.elastic})

    # ---- the loop ----

    def sampler(self, dataset: Any, *, batch_size: int, shuffle: bool = True, seed: int = 0) -> ResumableSampler:
        """This rank's share of `dataset` (DistributedSampler's order, drop_last), which `epochs()`
        positions at the resumed batch. Give the DataLoader the same `batch_size`. Exact as long as the
        dataset draws no random numbers (a DataLoader draws one from the global RNG when each epoch's
        iterator is made); for random augmentation use `loader()`."""
        sampler = ResumableSampler(len(dataset), rank=self.rank, world_size=self.world_size, seed=seed,
                                   shuffle=shuffle, keys=False)
        return self.follow(sampler, batch_size=batch_size)

    def loader(self, dataset: Any, *, batch_size: int, shuffle: bool = True, seed: int = 0,
               **options: Any) -> DataLoader:
        """A DataLoader over this rank's share that resumes exactly, random augmentation included: each
        sample draws from a seed of its own (seed, epoch, index), whichever worker loads it, and making an
        epoch's iterator draws from a generator of the loader's, not the training RNG. `options` go to
        DataLoader (num_workers, pin_memory, ...); loader workers ignore the stop signals and, when the
        session trains on the CPU, run at a lower priority than the rank (`loaders.worker_niceness`)."""
        sampler = ResumableSampler(len(dataset), rank=self.rank, world_size=self.world_size, seed=seed,
                                   shuffle=shuffle, keys=True)
        generator = torch.Generator().manual_seed(seed)
        if options.get("num_workers"):
            options.setdefault("worker_init_fn", worker_init(worker_niceness(self.device.type)))
        self.follow(sampler, batch_size=batch_size, generator=(generator, seed))
        return DataLoader(SeededSamples(dataset, seed), batch_size=batch_size, sampler=sampler, drop_last=True,
                          generator=generator, **options)

    def follow(self, sampler: ResumableSampler, *, batch_size: int, generator: tuple | None = None) -> ResumableSampler:
        """Have `epochs()` position a sampler made elsewhere (the trainer's, which yields seeded keys)."""
        self._samplers.append((sampler, batch_size, generator))
        return sampler

    def epochs(self, total: int, *, batches_per_epoch: int | None = None) -> Iterator[int]:
        """The epochs still to run, from the resumed one; each starts the samplers at the right batch.
        The resumed epoch is yielded even when a stop came after its last batch, so the code after the
        inner loop (evaluation, say) runs once, as it did in an uninterrupted run; its loader then yields
        nothing. A loop with no sampler passes `batches_per_epoch` (1: one step per epoch), and an epoch
        whose batches were all done is then not run again."""
        self.epochs_total = total
        while self.progress.epoch < total:
            if batches_per_epoch is None or self.progress.batch_in_epoch < batches_per_epoch:
                for sampler, batch_size, generator in self._samplers:
                    sampler.set_position(self.progress.epoch, self.progress.batch_in_epoch * batch_size)
                    if generator is not None:  # the same worker seeds in this epoch, resumed or not
                        generator[0].manual_seed(generator[1] * 1_000_003 + self.progress.epoch)
                yield self.progress.epoch
            self.progress.epoch += 1
            self.progress.batch_in_epoch = 0

    def flags(self, loss: float | torch.Tensor | None = None) -> torch.Tensor:
        """This rank's view of the step about to complete: [loss, stop requested, checkpoint due]. `step()`
        all-reduces it; a loop that can carry it on its own collective (the trainer's DDP hook) calls this
        before that collective and hands `step()` the sum."""
        step = self.progress.step + 1
        self._check_deadline()
        if str(step) in os.environ.get("HPC_DDP_FAULT_STOP_AT", "").split(","):
            self.stop.request("HPC_DDP_FAULT_STOP_AT")  # a rehearsal: as if the signal came during this step
        # Saves every N steps need no agreement (every rank counts steps); rank 0's clock does. Sent once:
        # on GPUs the next step's flags leave before this one's are read and the save resets the clock.
        due = bool(self.checkpoint_every_minutes and self.is_main and not self._due_sent
                   and time.monotonic() - self.last_save >= 60 * self.checkpoint_every_minutes)
        self._due_sent |= due
        on_device = isinstance(loss, torch.Tensor) and loss.device.type != "cpu"
        device = loss.device if on_device else self.device  # the process group's device (NCCL: the GPU)
        if device.type != "cpu":
            # Built on the device: a host->device copy of a list would wait for the queue. step() reads it late.
            self._sent = torch.zeros(3, dtype=torch.float64, device=device)
            if loss is not None:
                self._sent[0] = loss.detach().reshape(()) if isinstance(loss, torch.Tensor) else float(loss)
            if self.stop.requested:
                self._sent[1] = 1.0
            if due:
                self._sent[2] = 1.0
            return self._sent
        value = 0.0 if loss is None else float(loss.detach() if isinstance(loss, torch.Tensor) else loss)
        self._sent = torch.tensor([value, float(self.stop.requested), float(due)], dtype=torch.float64)
        return self._sent

    def step(self, loss: float | torch.Tensor | None = None, *, batches: int = 1, samples: int | None = None,
             summed: torch.Tensor | None = None, **metrics: float) -> bool:
        """Count one optimizer step (on every rank, after `optimizer.step()`): record metrics every
        `log_every` steps, save when a checkpoint is due, and when any rank was asked to stop, save and
        exit 75 (or return True with exit_on_stop=False). `batches`: loader batches it consumed (gradient
        accumulation); `samples`: samples it consumed on all ranks together, for samples/s. With the loss
        on a GPU, the step's flags are read by the next call (lagged.py): its record is written then, and a
        stop or a NaN in them is acted on there, or by a checkpoint due now, settle(), finish() or close()."""
        self._check_writer()  # a failed background checkpoint write stops the run here, not silently
        sent = self._sent if self._sent is not None else self.flags(loss)
        self._sent = None
        if summed is None:
            summed = sent
            if self.distributed:
                summed = sent.clone()
                dist.all_reduce(summed)
        now = time.monotonic()
        seconds = now - self._step_started
        self._step_started = now
        self.step_seconds = seconds if self.step_seconds is None else 0.9 * self.step_seconds + 0.1 * seconds
        p = self.progress
        p.step += 1
        self._attempt_steps += 1
        p.batch_in_epoch += batches
        p.samples += samples or 0
        self._fault_injection()
        done = _Done(p.step, p.epoch, now, p.samples, loss is not None)
        if summed.device.type == "cpu" and not self._lag_on_cpu:
            stop, due = self._agreed((done, metrics), summed.tolist())
        else:  # GPU: this step's flags are read by the next step() (lagged.py), so the host never waits here
            ready = self._lag.push(summed, (done, metrics))
            stop, due = self._agreed(*ready) if ready else (False, False)
        due = due or bool(self.checkpoint_every_steps and p.step % self.checkpoint_every_steps == 0)
        if due and not stop:
            stop = self._drain()[0]  # GPU: this step's own flags first, so a NaN or a stop in them wins
        stop, self._stop_read = stop or self._stop_read, False
        if stop:
            return self._stop_here()
        if due:
            self.save("periodic", wait=False)  # in the background when async checkpoints are on
        return False

    @contextlib.contextmanager
    def busy(self, what: str = "work that is not a step"):
        """Around work between steps that may take long (an evaluation, a big log upload): the stall watch
        does not count it, and the next step's time does not include it. Saves are already covered."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            self._step_started = time.monotonic()

    # What the stall watch (stallwatch.py) reads.
    def last_step_at(self) -> float:
        return self._step_started

    def steps_this_attempt(self) -> int:
        return self._attempt_steps

    def paused(self) -> bool:
        return self._busy > 0 or self._closed

    def _stalled(self, quiet: float, limit: float) -> None:
        """No step for `quiet` s, more than `limit`: name who hangs, record it, leave (the executor ends the
        other ranks). Runs on the watch's thread while the main thread waits, so it ends the process itself."""
        answer: list[str | None] = []
        asking = threading.Thread(target=lambda: answer.append(rendezvous.explain_failure(self.store, self.env)),
                                  daemon=True)
        asking.start()
        asking.join(STORE_ANSWER_S)
        # The store lives in rank 0's process: a rank 0 that hangs cannot answer for the others.
        who = answer[0] if answer else None if self.rank == 0 else (
            f"{rendezvous.describe_ranks(self.env, [0])} does not answer (it holds the rendezvous store): it died "
            "or hung")
        line = (f"no step completed for {quiet:.0f} s (the limit is {limit:.0f} s: {FACTOR:g} x the "
                f"{self.step_seconds or 0:.2f} s step, at least {self.stallwatch.min_s:g} s); "
                f"{who or 'every rank still answers, so one may be deadlocked'}; ending the attempt")
        print(f"hpc-ddp: error: rank {self.rank}: {line}", file=sys.stderr, flush=True)
        if answer:  # the store answers: the first rank to claim writes the record
            first = False
            with contextlib.suppress(Exception):
                first = int(self.store.add("stalled/claim", 1)) == 1
        else:  # it does not (rank 0 hangs): a request would wait for it; rank 1 writes the record
            first = self.rank == 1
        if first:  # one record, from the first rank that saw it (rank 0 may be the one that hangs)
            JsonLines(RunDir(self.run_dir).events).write(
                {"event": "stalled", "seconds": round(quiet, 1), "limit": round(limit, 1), "reason": who or line,
                 "step": self.progress.step, "job_id": self.env.job_id})
        if answer:
            rendezvous.mark_left(self.store, self.env, rendezvous.LEFT_AFTER_OTHERS)
        sys.stdout.flush()
        os._exit(STALL_EXIT_CODE)

    def settle(self) -> bool:
        """Act now on the last step's flags, which GPU runs read one step late: call it before work that is
        not a step (an evaluation at an epoch's end), so a stop requested in the last step is not held up
        by that work. Collective, like step(): every rank calls it at the same point. Returns what step()
        would have (True: stopped, with exit_on_stop=False). One host sync on GPUs; nothing to do on CPU."""
        stop, due = self._drain()
        stop, self._stop_read = stop or self._stop_read, False
        if stop:
            return self._stop_here()
        if due:
            self.save("periodic", wait=False)
        return False

    def _agreed(self, tagged: tuple["_Done", Mapping[str, float]], values: list[float]) -> tuple[bool, bool]:
        """Act on one step's summed flags: check and record its loss; return (stop, checkpoint due)."""
        (done, metrics), (total_loss, stop, due) = tagged, values
        mean_loss = total_loss / self.world_size if done.has_loss else None
        if mean_loss is not None and self.stop_on_nonfinite and not math.isfinite(mean_loss):
            self._lag.discard()  # steps after a NaN: not recorded
            raise Diverged(f"the loss is {mean_loss} at step {done.step} (mean over {self.world_size} ranks); "
                           "stopping without a checkpoint or a requeue", hint="lower the learning rate, clip "
                           "gradients, or check the data; the last checkpoint is kept")
        self._record(done, mean_loss, metrics)
        return stop > 0, due > 0

    def _drain(self, timeout: float | None = None) -> tuple[bool, bool]:
        """Act on the step whose flags are still in flight (GPU): record it; return its (stop, due). A
        stop read here and not acted on by the caller (an explicit save()) is acted on by the next step()
        or settle(). `timeout`: raise TimeoutError (and drop the record) after that long."""
        ready = self._lag.drain(timeout)
        if ready is None:
            return False, False
        stop, due = self._agreed(*ready)
        self._stop_read |= stop
        return stop, due

    def _record(self, done: "_Done", loss: float | None, metrics: Mapping[str, float]) -> None:
        if done.step % self.log_every and done.step != self.total_steps:
            return
        started, _first_step, first_samples = self._window
        rate = (done.samples - first_samples) / max(done.when - started, 1e-9)
        record = {"step": done.step, "epoch": done.epoch, **({"loss": loss} if loss is not None else {}),
                  **metrics, "samples_per_s": round(rate, 2), "restarts": self.progress.restarts}
        self.metrics.write(record)
        self.loggers.write(record)
        self._window = (done.when, done.step, done.samples)
        if self.is_main:
            of = f"/{self.total_steps}" if self.total_steps else ""
            epochs = f"/{self.epochs_total}" if self.epochs_total else ""
            parts = [f"step {done.step}{of}", f"epoch {done.epoch + 1}{epochs}"]
            parts += [f"loss {loss:.4f}"] if loss is not None else []
            parts += [f"{k} {v:.4g}" for k, v in metrics.items()]
            parts += [f"{rate:,.0f} samples/s"] if done.samples else []
            tty = sys.stdout.isatty()
            print(("\r" if tty else "") + "  ".join(parts), end="" if tty else "\n", flush=True)
            self._bar_open = tty

    def log_metrics(self, **metrics: float) -> None:
        """One record in metrics.jsonl at the current step (evaluation results, say). Rank 0 writes."""
        record = {"step": self.progress.step, "epoch": self.progress.epoch, **metrics}
        self.metrics.write(record)
        self.loggers.write(record)

    # ---- stopping ----

    def _lead(self) -> float:
        lead = stop_lead(self.save_seconds, self.step_seconds, self.stop_lead_seconds)
        if self.deadline is not None and not self.stop_lead_seconds:
            lead = min(lead, 0.25 * (self.deadline - self.started))  # short limits still get work done
        return lead

    def _check_deadline(self) -> None:
        """Stop before the time limit by the measured lead, even if Slurm's warning signal is late."""
        if self.deadline is not None and not self.stop.requested and time.time() >= self.deadline - self._lead():
            self.stop.request("deadline")

    def _stop_cause(self) -> str:
        """A stop near the job's end time is the time limit; any other is a preemption (or a rehearsal)."""
        if self.deadline is None:
            return "preempted"
        near = max(self.signal_lead, self._lead()) + 90  # Slurm may signal up to 60 s early
        return "time_limit" if self.deadline - time.time() <= near else "preempted"

    def _stop_here(self) -> bool:
        self._drain()  # records the last step before the stop's own lines
        why = self.stop.received or "a stop request on another rank"
        cause = self._stop_cause()
        self.events.write({"event": "signal", "signal": why, "cause": cause, "step": self.progress.step,
                           "lead_s": round(self._lead(), 1)})
        self.log(f"hpc-ddp: stop requested ({why}, {cause.replace('_', ' ')}); "
                 f"checkpointing at step {self.progress.step}")
        self.requeue()
        return True

    def requeue(self) -> None:
        """Checkpoint now and exit 75, so the job is requeued and resumes here. Collective, like save()."""
        self._drain()
        self._stop_read = False  # this is the stop: one found in the last flags is not acted on again
        self.save("stop")
        self.events.write({"event": "requeue_requested", "step": self.progress.step, "exit_code": REQUEUE_EXIT_CODE})
        if self.exit_on_stop:
            raise SystemExit(REQUEUE_EXIT_CODE)

    def finish(self) -> Path | None:
        """The final checkpoint and the "finish" record: the run is complete."""
        self._drain()
        path = self.save("final")
        self.events.write({"event": "finish", "step": self.progress.step, "epoch": self.progress.epoch})
        self.log(f"hpc-ddp: training finished at step {self.progress.step}; checkpoints in {self.checkpoints.root}")
        return path

    def warn_if_handlers_replaced(self) -> None:
        lost = self.stop.still_installed()
        if lost:
            self.log(f"hpc-ddp: warning: the handler for SIG{', SIG'.join(lost)} was replaced after start-up "
                     "(by a communication library?); stop requests on it will not checkpoint")

    def _fault_injection(self) -> None:
        """Rehearsal knobs: HPC_DDP_FAULT_KILL_AT=N[:R] SIGKILLs rank R (default 0) after step N (a node
        failure); HPC_DDP_FAULT_HANG_AT=N[:R] SIGSTOPs it (a hung rank)."""
        for knob, sig in (("HPC_DDP_FAULT_KILL_AT", signal.SIGKILL), ("HPC_DDP_FAULT_HANG_AT", signal.SIGSTOP)):
            at, _, who = os.environ.get(knob, "").partition(":")
            if at == str(self.progress.step) and self.rank == int(who or 0):
                os.kill(os.getpid(), sig)


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


def _saved_accum(manifest: Mapping[str, Any] | None) -> int | None:
    """The gradient accumulation the run used when it saved (None: a run that never asked `accumulation()`)."""
    accum = (manifest or {}).get("grad_accum")
    return accum if type(accum) is int and accum > 0 else None


def _saved_world(manifest: Mapping[str, Any] | None) -> int | None:
    """The world size that saved a checkpoint, from its manifest's fingerprint (None: none, or not said)."""
    world = ((manifest or {}).get("fingerprint") or {}).get("world_size")
    return world if type(world) is int and world > 0 else None


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


def _fault_before_join(env: DistEnv) -> None:
    """HPC_DDP_FAULT_NO_JOIN=R: rank R hangs before the rendezvous (a rank that never starts: no stop
    flag of ours yet, so a SIGTERM ends it as it would a process still starting up)."""
    if os.environ.get("HPC_DDP_FAULT_NO_JOIN") == str(env.rank):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(10**6)


def _state_of(obj: Any) -> Any:
    if isinstance(obj, nn.parallel.DistributedDataParallel):
        obj = obj.module
    return dict(obj) if isinstance(obj, dict) else obj.state_dict()


def _load_into(obj: Any, state: Any) -> None:
    if isinstance(obj, nn.parallel.DistributedDataParallel):
        obj = obj.module
    if isinstance(obj, dict):
        obj.clear()
        obj.update(state)
    else:
        obj.load_state_dict(state)


_PLAIN = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


def _check_plain(value: Any, where: str) -> None:
    """Refuse, before anything is written, state the weights-only loader would refuse on resume (a
    function, a lambda, an object of the user's class): the checkpoint could never be loaded."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise _not_plain(f"{where} has a key of type {type(key).__name__}")
            _check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    raise _not_plain(f"{where} is a {type(value).__module__}.{type(value).__qualname__}")


def _not_plain(what: str) -> UsageError:
    return UsageError(f"cannot checkpoint: {what}; checkpoints hold tensors, numbers, strings and containers "
                      "of them (they load with weights_only=True, which refuses code)",
                      hint="keep functions and objects out of state_dict(); rebuild them from settings on resume")


def _one_line_errors() -> None:
    """An hpc-ddp error a user's script does not catch (misuse, a refused resume) prints as one line with
    its hint and exits with its code, as the CLI's do; any other exception keeps its traceback."""
    previous = sys.excepthook
    if getattr(previous, "_hpc_ddp", False):
        return

    def hook(kind, exc, tb):
        if isinstance(exc, HpcDdpError):
            exit_after_handlers(report(exc))  # the error's code (2 for misuse), which only _exit sets here
        previous(kind, exc, tb)
    hook._hpc_ddp = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _summary(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
