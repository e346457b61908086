"""The Session's checkpoints: what one holds (`track`), writing it (`save`, durable or in the background,
asyncsave.py), and resuming from the newest that verifies (`resume`), on another world size where the run
allows it (`accumulation`, data.elastic). A part of `session.Session` (see session.py's docstring)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpc_ddp.data.elastic import Resized, Split, resize
from hpc_ddp.trainer import rendezvous
from hpc_ddp.trainer.checkpoint import Loaded, state_sha256
from hpc_ddp.trainer.rngstate import capture_rng, restore_rng
from hpc_ddp.trainer.sessionbase import IncompatibleResume, Progress, UsageError, at_least_one
from hpc_ddp.trainer.sharded import (
    Sharded,
    agree_on_sharding,
    host_copy,
    is_sharded_checkpoint,
    is_sharded_module,
    load_sharded,
    refuse_unsupported,
    save_sharded,
)

SESSION_FILE = "session.pt"   # progress + every rank's RNG streams, next to the tracked states
_CALLS = {"final": "finish", "stop": "requeue"}   # a save's reason -> the call every rank must make with it


class SaveAndResume:
    """Session's checkpoint methods (its state is made in Session.__init__)."""

    def track(self, **objects: Any) -> None:
        """Name the states a checkpoint holds: modules (a DDP wrapper is unwrapped), optimizers,
        schedulers, scalers, anything with state_dict()/load_state_dict(), or a plain dict (updated in
        place on resume). `model=` is the one `hpc-ddp inspect` hashes. A model sharded with FSDP2
        (`fully_shard`) is tracked with its optimizer; then every rank writes its shards (trainer.sharded)."""
        if self._resume_called:
            raise UsageError(f"track({', '.join(objects)}=...) after resume(): the checkpoint was already loaded, so "
                             "these would train on from fresh weights while the step count goes on",
                             hint="call run.track(...) before run.resume()")
        for name, obj in objects.items():
            if not name.isidentifier() or f"{name}.pt" == SESSION_FILE:
                raise UsageError(f"track(): {name!r} cannot name a checkpoint file",
                                 hint="use a plain identifier other than 'session'")
            if not (isinstance(obj, dict) or hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise UsageError(f"track(): {name}={type(obj).__name__} has no state_dict()/load_state_dict()",
                                 hint="track modules, optimizers, schedulers, or a dict of tensors and numbers")
            refuse_unsupported(name, obj)
            self._tracked[name] = obj
        self._sharded = None  # asked again (collectively) at the next save or resume

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
        self._all_arrive(_CALLS.get(reason, "save"))
        rng = [capture_rng()]
        if self.distributed:
            rng = [None] * self.world_size
            dist.all_gather_object(rng, capture_rng())
        sharded = self._sharded_states()
        # A sharded save in the background is proven on CPUs (gloo) only: on GPUs it blocks until it is.
        background = not wait and self._writer is not None and (not sharded or self.device.type == "cpu")
        path = payloads = None
        if self.is_main:
            payloads = {f"{name}.pt": _state_of(obj) for name, obj in self._tracked.items()
                        if name not in sharded.names}
            payloads[SESSION_FILE] = {"progress": dataclasses.asdict(self.progress), "rng": rng}
            for fname, payload in payloads.items():
                _check_plain(payload, fname.removesuffix(".pt"))
        if sharded:
            path = self._save_sharded(sharded, payloads, reason, started, background)
        elif self.is_main:
            if background:
                self._save_in_background(payloads, reason, started)
            else:
                path = self._save_now(payloads, reason, started)
        if self.distributed and not background and not sharded:
            dist.barrier()  # nobody exits or goes on before the checkpoint is durable (a sharded save's end agrees)
        self.last_save, self._due_sent = time.monotonic(), False
        return path

    def _save_now(self, payloads: dict[str, Any], reason: str, started: float) -> Path:
        """Rank 0: wait for the write in flight (at most one at a time), then write this one and return
        once it is durable."""
        self.wait_for_checkpoint()
        path = self.checkpoints.save(self.progress.step, payloads, self._meta(payloads, reason))
        self._saved(path, reason, self.progress.step, self.progress.epoch, time.monotonic() - started)
        return path

    def _save_sharded(self, sharded: Sharded, payloads: dict[str, Any] | None, reason: str, started: float,
                      background: bool) -> Path | None:
        """Every rank: its shards, with DCP; rank 0 also `payloads` and the manifest (trainer.sharded). In
        the background: every rank copies its shards to host memory (what blocks the loop), and its writer
        thread writes them, its collectives on a process group of their own; at most one in flight."""
        self.wait_for_checkpoint()
        step, epoch = self.progress.step, self.progress.epoch
        meta = self._meta(payloads or {}, reason) if self.is_main else {}
        if not background:
            path = save_sharded(self.checkpoints, sharded, step, payloads, meta, self.rank, self.world_size)
            if self.is_main:
                self._saved(path, reason, step, epoch, time.monotonic() - started)
            return path
        group = self._checkpoint_group()
        state = self._sharded_host = host_copy(sharded.state(), getattr(self, "_sharded_host", None))
        payloads = host_copy(payloads)
        blocked = time.monotonic() - started

        def write() -> Path | None:
            return save_sharded(self.checkpoints, sharded, step, payloads, meta, self.rank, self.world_size,
                                state=state, group=group)

        self._writer.start(write, done=(lambda path, seconds: self._saved(
            path, reason, step, epoch, blocked + seconds, blocked=blocked)) if self.is_main else None)
        return None

    def _checkpoint_group(self) -> Any:
        """The gloo group a background sharded save's collectives use (made once, by every rank at the same
        save): on the loop's own group they would interleave with the training's collectives."""
        if getattr(self, "_ckpt_group", None) is None:
            from datetime import timedelta

            self._ckpt_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.collective_timeout))
        return self._ckpt_group

    def _sharded_states(self) -> Sharded:
        """The tracked states that are sharded (FSDP2), checked the same on every rank (collective, once
        after each track())."""
        if getattr(self, "_sharded", None) is None:
            found = Sharded(self._tracked)
            if self.distributed:
                agree_on_sharding(bool(found), self.rank, self.world_size)
            self._sharded = found
        return self._sharded

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
        self._save_measured(blocked if blocked is not None else seconds)  # "auto": w, what blocks the loop
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
        if self._split is not None:  # an uneven split's G is not batch x ranks x rank 0's accumulation
            meta["global_batch"] = self._split.global_batch
        batch_size = self._known_batch_size()
        if batch_size is not None:  # the unit of batch_in_epoch: a resume with another one is refused
            meta["batch_size"] = batch_size
        if model_hash and "model.pt" in payloads:
            meta["model_sha256"] = state_sha256(payloads["model.pt"])
        return meta

    def _all_arrive(self, what: str) -> None:
        """Every rank must reach this call: name those that do not, instead of hanging in a collective
        until its timeout (the usual mistake: `if rank == 0: run.save()`). A rank whose call of the same
        number is another one (rank 0's save() where rank 1 calls finish()), or that left the run, is
        named at once: waiting for it could only end at the timeout (issue 43: still hung after 150 s)."""
        if not self.distributed or self.store is None:
            return
        self._saves += 1
        number, store, env = self._saves, self.store, self.env
        sharded = any(is_sharded_module(obj) for obj in self._tracked.values())  # local: no collective here
        writer = "every rank writes its shards of the checkpoint" if sharded else "rank 0 alone writes the checkpoint"
        last = [time.monotonic()]

        def check() -> None:
            if time.monotonic() - last[0] < 1.0:
                return
            last[0] = time.monotonic()
            for other in sorted({"save", *_CALLS.values()} - {what}):
                if int(store.add(f"{other}/{number}/count", 0)) > 0:
                    there = [r for r in range(env.world_size) if r != env.rank and store.check([f"{other}/{number}/{r}"])]
                    raise UsageError(
                        f"{what}() is collective, but {rendezvous.describe_ranks(env, there)} called {other}() "
                        f"where rank {env.rank} called {what}()",
                        hint=f"call run.{what}() on every rank at the same point; {writer}")
            gone = {r: why for r, why in rendezvous.left_ranks(store).items()
                    if not store.check([f"{what}/{number}/{r}"])}
            if gone:
                why = next(iter(gone.values()))
                raise UsageError(f"{what}() is collective, but {rendezvous.describe_ranks(env, list(gone))} left the "
                                 f"run ({why}) without calling it (rank {env.rank} did)",
                                 hint=f"call run.{what}() on every rank; {writer}")

        missing = rendezvous.wait_for_all(store, env, f"{what}/{number}", self.collective_timeout, check)
        if missing:
            raise UsageError(
                f"{what}() is collective, but {rendezvous.describe_ranks(self.env, missing)} did not call it "
                f"within {self.collective_timeout:g} s (rank {self.rank} did)",
                hint=f"call run.{what}() on every rank; {writer}")

    def resume(self, total_steps: int | None = None) -> bool:
        """Load the newest checkpoint that verifies into the tracked states, restore progress and this
        rank's RNG; False (and a "start" record) when there is none. `total_steps` is the run's length:
        `status` shows progress against it, and a checkpoint beyond it is refused (BeyondSchedule)."""
        self.total_steps = total_steps or self.total_steps
        self._resume_called = True
        sharded = self._sharded_states()
        if sharded:
            plain = tuple(f"{name}.pt" for name in self._tracked if name not in sharded.names) + (SESSION_FILE,)
            loaded = load_sharded(self.checkpoints, sharded, plain, self.total_steps, self.rank, self.world_size,
                                  self.log)
        else:
            if is_sharded_checkpoint(self.checkpoints.latest_manifest()):
                raise IncompatibleResume(
                    f"cannot resume from the checkpoints in {self.checkpoints.root}: they were saved from a sharded "
                    "model (fully_shard), and this run's model is not sharded",
                    hint="shard the model as the run that saved it did (fully_shard), or start from its weights: "
                         "hpc-ddp export RUN --to model.pt writes them as one file")
            loaded = self.checkpoints.load_latest(max_step=self.total_steps)  # beyond the schedule: refused
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
            if name in sharded.names:
                continue  # loaded by load_sharded
            try:
                _load_into(obj, loaded.payloads[f"{name}.pt"])
            except (RuntimeError, KeyError, ValueError, TypeError) as exc:
                first = (str(exc).strip().splitlines() or [""])[0].strip().rstrip(":.")
                raise IncompatibleResume(
                    f"cannot resume from {loaded.path}: its {name} does not fit this run's {name} "
                    f"({type(exc).__name__}: {first[:200]})",
                    hint=f"build the same {name} as the run that saved it, or start afresh with another --run-dir"
                ) from None
        session = loaded.payloads[SESSION_FILE]
        self.progress = Progress(**session["progress"])
        self.progress.restarts += 1
        saved_world = len(session["rng"])
        self._check_batch(loaded.manifest, self._known_batch_size())
        saved_global = _saved_global(loaded.manifest)
        if saved_world != self.world_size or (saved_global and self._batch_size and
                                               not Split(saved_global, self._batch_size, saved_world).even):
            self._resume_resized(saved_world, _saved_accum(loaded.manifest), saved_global)
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
        """The micro-batches per optimizer step from now on (the same on every rank): `grad_accum`, unless
        this run resumes on another world size than the checkpoint's and keeps the global batch (`elastic =
        "keep_global_batch"`, a node range's default): then as many more or fewer as keep the global batch.
        Where the new size does not divide it (32 = 4 x 8 on 3 ranks: 2 micro-steps of 16), the ranks' batches
        differ (6, 5, 5): take `batch_size()` per batch and multiply each batch's loss by `loss_weight()`
        (data.elastic). Ask it before the loop's schedule is built (the steps per epoch follow from it) and
        before `resume()`."""
        at_least_one("accumulation", grad_accum=grad_accum, batch_size=batch_size)
        manifest = self.checkpoints.latest_manifest()
        saved, used = _saved_world(manifest), _saved_accum(manifest)
        self._check_batch(manifest, batch_size)
        self._batch_size = batch_size
        if saved is None:
            self._accum = grad_accum
            self._split = Split(batch_size * self.world_size * grad_accum, batch_size, self.world_size)
        else:  # a run resized before goes on with the accumulation it had
            moved = self._resize(saved, batch_size, used or grad_accum, 0, _saved_global(manifest))
            self._accum, self._split = moved.grad_accum, moved.split
        self._size_loaders()
        return self._accum

    def batch_size(self) -> int:
        """This rank's micro-batch: the `batch_size` given to `accumulation()` (or the first sampler), or,
        after a resume on a size that splits the global batch unevenly (data.elastic), this rank's share of
        it (at most that). Build the DataLoader of a `sampler()` with it; `loader()`'s follow by themselves."""
        self._batch_asked = True
        if self._split is not None:
            return self._split.rank_batch(self.rank)
        known = self._known_batch_size()
        if known is None:
            raise UsageError("batch_size() before the batch size is known",
                             hint="call run.accumulation(grad_accum, batch_size=B) or run.sampler(..., batch_size=B) first")
        return known

    def _size_loaders(self) -> None:
        """The DataLoaders `loader()` made take this rank's batch of the split (they read it per epoch)."""
        if self._split is None:
            return
        for loader, planned in self._loaders:  # those of the split's batch (an evaluation's keeps its own)
            if planned == self._split.batch_size:
                loader.batch_sampler.batch_size = self._split.rank_batch(self.rank)

    def loss_weight(self) -> float:
        """What each micro-batch's mean loss is multiplied by before backward(), so that DDP's average over
        ranks is the global batch's mean gradient: 1 / accumulation while every rank takes the same number
        of micro-batches; W / C (C micro-batches of the global batch on W ranks) after a resume that split it
        unevenly: b_r x W / G, this rank's share. 1.0 before `accumulation()`."""
        return self._split.loss_weight(self.rank) if self._split is not None else 1.0

    def _known_batch_size(self) -> int | None:
        return self._batch_size or (self._samplers[0][1] if self._samplers else None)

    def _check_batch(self, manifest: Mapping[str, Any] | None, batch_size: int | None) -> None:
        """The checkpoint counts the epoch's position in batches of the size it was saved with: another
        size would start the samplers elsewhere and skip or repeat samples (issue 43). Refused, named."""
        saved = (manifest or {}).get("batch_size")
        if type(saved) is int and batch_size is not None and saved != batch_size:
            raise IncompatibleResume(
                f"cannot resume with batch_size {batch_size}: the checkpoint was saved with batch_size {saved} "
                "(its place in the epoch is counted in those batches; another size would skip or repeat samples)",
                hint=f"resume with batch_size={saved}, or start afresh with another --run-dir")

    def _resize(self, saved: int, batch_size: int, grad_accum: int, batch_in_epoch: int,
                global_batch: int | None = None) -> Resized:
        if self.elastic is None and saved != self.world_size:
            raise IncompatibleResume(
                f"cannot resume: the checkpoint was saved by {saved} ranks, this run has {self.world_size} (a fixed "
                "number of nodes: each rank's data order and random streams are in it)",
                hint=f"resume with the same nodes x GPUs ({saved} ranks), or submit with --nodes MIN-MAX (a range) "
                     "to let a run resume on another size")
        try:
            return resize(saved_world=saved, world=self.world_size, batch_size=batch_size, grad_accum=grad_accum,
                          batch_in_epoch=batch_in_epoch, policy=self.elastic or "keep_global_batch",
                          global_batch=global_batch, rank=self.rank)
        except ValueError as exc:
            raise IncompatibleResume(f"cannot resume on {self.world_size} ranks: {exc}",
                                     hint="resume on fewer nodes, or set --elastic keep_per_rank_batch") from None

    def _check_compatible(self, loaded: Loaded) -> None:
        saved = loaded.manifest.get("fingerprint") or {}
        if saved.get("world_size") not in (None, self.world_size) and self.elastic is None:
            self._resize(int(saved["world_size"]), 1, 1, 0)  # refused, naming the range option
        changed = [f"{k}: checkpoint {saved.get(k)!r}, now {v!r}" for k, v in self.fingerprint.items()
                   if saved.get(k) != v and not (k == "world_size" and self.elastic)]
        if changed:
            raise IncompatibleResume(f"cannot resume from {loaded.path}: the run changed {'; '.join(changed)}",
                                     hint="restore those settings, or start afresh with another --run-dir")

    def _resume_resized(self, saved_world: int, saved_accum: int | None, saved_global: int | None) -> None:
        """Go on at this world size from where `saved_world` ranks stopped: the same global position in the
        epoch's order (data.elastic). The batch size is the one `accumulation()` was told, else the first
        followed sampler's; the saved run's accumulation is in its checkpoint (1 where it was never asked).
        Also for the same size when the saved run split its global batch unevenly: each rank's own count."""
        batch_size = self._known_batch_size()
        if batch_size is None:
            raise IncompatibleResume(
                f"cannot resume on {self.world_size} ranks what {saved_world} saved: this loop has no run.sampler() "
                "or run.loader() and never told run.accumulation() its batch size, so where its data stopped is "
                "not known in samples",
                hint=f"resume on {saved_world} ranks, or give the loop run.sampler(...) (or call "
                     "run.accumulation(accum, batch_size=B)) before run.resume()")
        moved = self._resize(saved_world, batch_size, saved_accum or 1, self.progress.batch_in_epoch, saved_global)
        if moved.split is not None and not moved.split.even and (self._accum is None or not self._batch_asked):
            raise IncompatibleResume(
                f"cannot resume on {self.world_size} ranks: the global batch of {moved.global_batch} splits unevenly "
                f"there (per-rank batches {moved.split.rank_batch(0)} to {moved.split.rank_batch(self.world_size - 1)}"
                f", {moved.split.accum} a step), and this loop never asked for "
                f"{'run.accumulation()' if self._accum is None else 'run.batch_size()'}",
                hint="before run.resume(): accum = run.accumulation(grad_accum, batch_size=B); build the DataLoader "
                     "with batch_size=run.batch_size() (run.loader() does it); multiply each batch's loss by "
                     "run.loss_weight()")
        if self._accum is not None and moved.grad_accum != self._accum:
            raise IncompatibleResume(f"the checkpoint resumed is not the one the run planned with (accumulation "
                                     f"{self._accum}, this one needs {moved.grad_accum})",
                                     hint="resubmit: the next attempt plans with the checkpoint it finds")
        self._accum, self._split = moved.grad_accum, moved.split
        self._size_loaders()
        self.progress.batch_in_epoch = moved.batch_in_epoch
        if saved_world == self.world_size:
            return
        fresh = f"; ranks {saved_world}-{self.world_size - 1} had no random streams in the checkpoint and start from " \
                "their seeds" if self.world_size > saved_world else ""
        self.log(f"hpc-ddp: {moved.note}{fresh}")
        record = {"event": "resized", "from_world_size": saved_world, "world_size": self.world_size,
                  "grad_accum": moved.grad_accum, "global_batch": moved.global_batch, "policy": self.elastic}
        if moved.split is not None and not moved.split.even:
            record.update({"batch_per_rank": [moved.split.rank_batch(r) for r in range(self.world_size)],
                           "loss_weight_per_rank": [moved.split.loss_weight(r) for r in range(self.world_size)]})
        self.events.write(record)


def _saved_global(manifest: Mapping[str, Any] | None) -> int | None:
    """The global batch the saving run trained with, where its checkpoint says (None: older checkpoints)."""
    value = (manifest or {}).get("global_batch")
    return value if type(value) is int and value > 0 else None


def _saved_accum(manifest: Mapping[str, Any] | None) -> int | None:
    """The gradient accumulation the run used when it saved (None: a run that never asked `accumulation()`)."""
    accum = (manifest or {}).get("grad_accum")
    return accum if type(accum) is int and accum > 0 else None


def _saved_world(manifest: Mapping[str, Any] | None) -> int | None:
    """The world size that saved a checkpoint, from its manifest's fingerprint (None: none, or not said)."""
    world = ((manifest or {}).get("fingerprint") or {}).get("world_size")
    return world if type(world) is int and world > 0 else None


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
