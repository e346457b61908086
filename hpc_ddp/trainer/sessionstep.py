"""The Session's loop: the samplers and epochs it positions, `step()` with its flags agreed by all ranks
(read one step late on GPUs, lagged.py), the records it writes, the stall watch's view of it, and stopping:
the deadline, a stop at an agreed step, `requeue()` and `finish()`. A part of `session.Session` (see
session.py's docstring)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from hpc_ddp.common.errors import HpcDdpError
from hpc_ddp.common.events import JsonLines, read_jsonl
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.data.loaders import ResumableSampler, SeededSamples, worker_init, worker_niceness
from hpc_ddp.job.deadline import stop_lead
from hpc_ddp.trainer import interval, rendezvous
from hpc_ddp.trainer.sessionbase import Diverged, UsageError, at_least_one
from hpc_ddp.trainer.stallwatch import FACTOR, STALL_EXIT_CODE, STORE_ANSWER_S


@dataclasses.dataclass(frozen=True)
class _Done:
    """A completed step, as its record will say (written when its flags are read: one step late on GPUs)."""
    step: int
    epoch: int
    when: float       # time.monotonic() at its step()
    samples: int
    has_loss: bool


class StepAndStop:
    """Session's loop and stopping methods (its state is made in Session.__init__)."""

    def sampler(self, dataset: Any, *, batch_size: int, shuffle: bool = True, seed: int = 0) -> ResumableSampler:
        """This rank's share of `dataset` (DistributedSampler's order, drop_last), which `epochs()`
        positions at the resumed batch. Give the DataLoader the same `batch_size`. Exact as long as the
        dataset draws no random numbers (a DataLoader draws one from the global RNG when each epoch's
        iterator is made); for random augmentation use `loader()`."""
        at_least_one("sampler", batch_size=batch_size)
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
        at_least_one("loader", batch_size=batch_size)
        sampler = ResumableSampler(len(dataset), rank=self.rank, world_size=self.world_size, seed=seed,
                                   shuffle=shuffle, keys=True)
        generator = torch.Generator().manual_seed(seed)
        if options.get("num_workers"):
            options.setdefault("worker_init_fn", worker_init(worker_niceness(self.device.type)))
        self.follow(sampler, batch_size=batch_size, generator=(generator, seed))
        loader = DataLoader(SeededSamples(dataset, seed), batch_size=batch_size, sampler=sampler, drop_last=True,
                            generator=generator, **options)
        self._loaders.append((loader, batch_size))
        self._batch_asked = True   # its batch follows the split (_size_loaders)
        self._size_loaders()
        return loader

    def follow(self, sampler: ResumableSampler, *, batch_size: int, generator: tuple | None = None) -> ResumableSampler:
        """Have `epochs()` position a sampler made elsewhere (the trainer's, which yields seeded keys)."""
        at_least_one("follow", batch_size=batch_size)
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
                split = self._split if self._split is not None and not self._split.even else None
                for sampler, batch_size, generator in self._samplers:
                    if split is not None and batch_size == split.batch_size:  # uneven: whole steps of the split
                        sampler.place(self.progress.epoch, self.progress.batch_in_epoch // max(1, self._accum or 1)
                                      * split.global_batch, split)
                    else:
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
        if self._interval_dirty:
            self._choose_interval()
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

    # ---- checkpoint_every_minutes = "auto" (interval.py), on rank 0 ----

    def _start_interval(self) -> None:
        """At setup: the run's history now, sacct in the background (once per attempt, bounded), the first
        choice from the history and the prior."""
        try:
            events = read_jsonl(RunDir(self.run_dir).events)
        except (OSError, HpcDdpError):
            events = []
        self._interval_inputs = {"history": interval.from_history(events, nodes=self.env.num_nodes, now=time.time()),
                                 "save_s": None}
        if os.environ.get("SLURM_JOB_ID"):
            partition = os.environ.get("SLURM_JOB_PARTITION")
            self._interval_inputs["sacct"] = interval.Evidence(
                "sacct", 0, 0.0, f"asked about partition {partition}: the interval is chosen again when it answers")

            def ask() -> None:
                self._interval_inputs["sacct"] = interval.from_sacct(partition)
                self._interval_dirty = True
            threading.Thread(target=ask, name="hpc-ddp-sacct", daemon=True).start()
        else:
            self._interval_inputs["sacct"] = interval.Evidence("sacct", 0, 0.0, "not a Slurm job: not asked")
        self._choose_interval()

    def _choose_interval(self) -> None:
        """Young's interval from what is known now; one `checkpoint_interval` event and one line."""
        self._interval_dirty = False
        inputs = self._interval_inputs
        left = self.deadline - time.time() if self.deadline is not None else None
        record = interval.choose(save_s=inputs.get("save_s"), nodes=self.env.num_nodes,
                                 evidence=[inputs["history"], inputs["sacct"]], time_left_s=left)
        self.checkpoint_every_minutes = record["seconds"] / 60.0
        self.events.write({**record, "step": self.progress.step, "job_id": self.env.job_id})
        self.log(f"hpc-ddp: checkpoint every {record['minutes']:g} min (checkpoint_every_minutes = \"auto\"; "
                 f"{record['why']})")

    def _save_measured(self, seconds: float) -> None:
        """The first save of the attempt gives w its measured value (any thread; rank 0 re-chooses at its
        next step)."""
        if self.auto_interval and self.is_main and self._interval_inputs.get("save_s") is None \
                and self._interval_inputs:
            self._interval_inputs["save_s"] = seconds
            self._interval_dirty = True

    def step(self, loss: float | torch.Tensor | None = None, *, batches: int = 1, samples: int | None = None,
             summed: torch.Tensor | None = None, **metrics: float) -> bool:
        """Count one optimizer step (on every rank, after `optimizer.step()`): record metrics every
        `log_every` steps, save when a checkpoint is due, and when any rank was asked to stop, save and
        exit 75 (or return True with exit_on_stop=False). `batches`: loader batches it consumed (gradient
        accumulation; >= 1); `samples`: samples it consumed on all ranks together, for samples/s, status's
        ETA and the timeline: derived from the batch size `sampler()`, `loader()` or `accumulation()` was told
        (batches x batch x ranks, the global batch per step when uneven) where not given. With the loss
        on a GPU, the step's flags are read by the next call (lagged.py): its record is written then, and a
        stop or a NaN in them is acted on there, or by a checkpoint due now, settle(), finish() or close()."""
        if self._finished:
            raise UsageError("step() after finish(): the run is complete and its final checkpoint written",
                             hint="call run.finish() once, after the last step")
        at_least_one("step", batches=batches)
        if samples is None:
            samples = self._samples_in(batches)
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

    def _samples_in(self, batches: int) -> int:
        """Samples a step of `batches` loader batches consumed on all ranks together, where the batch size is
        known: batches x batch x ranks, or this rank's share of an uneven split's global batch scaled up."""
        if self._split is not None and self._accum:
            return batches * self._split.global_batch // self._accum
        batch_size = self._samplers[0][1] if self._samplers else self._batch_size
        return batches * batch_size * self.world_size if batch_size else 0

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
        """No step is expected: busy, closed, or finished (a script's exit after finish() may take a while:
        other threads joined, the process group destroyed; the watch must not call that a stall)."""
        return self._busy > 0 or self._closed or self._finished

    def _stalled(self, quiet: float, limit: float) -> None:
        """No step for `quiet` s, more than `limit`: name who hangs, record it, leave (the executor ends the
        other ranks). Runs on the watch's thread while the main thread waits, so it ends the process itself.
        Returns (the watch goes on) when a step completed, or the run finished, while the store was asked:
        the quiet was one long step, not a hang, and ending the attempt then would fail a run that went on."""
        seen = self.last_step_at()
        answer: list[str | None] = []
        asking = threading.Thread(target=lambda: answer.append(rendezvous.explain_failure(self.store, self.env)),
                                  daemon=True)
        self._asking = asking  # close() waits for it: a store call cut by the process's exit aborts it (-6)
        asking.start()
        asking.join(STORE_ANSWER_S)
        if self.last_step_at() != seen or self.paused():
            print(f"hpc-ddp: warning: rank {self.rank}: no step completed for {quiet:.0f} s (the limit is "
                  f"{limit:.0f} s), then the run went on: not a stall", file=sys.stderr, flush=True)
            return
        # The store lives in rank 0's process: a rank 0 that hangs cannot answer for the others.
        alone = self.store is None  # a world of one: no store, no peer; the hang is this process's own
        who = ("the run's only rank is alive but its loop made no progress (a deadlock, or a wait on a "
               "filesystem or data loader that does not answer)") if alone else \
            answer[0] if answer else None if self.rank == 0 else (
            f"{rendezvous.describe_ranks(self.env, [0])} does not answer (it holds the rendezvous store): it died "
            "or hung")
        line = (f"no step completed for {quiet:.0f} s (the limit is {limit:.0f} s: {FACTOR:g} x the "
                f"{self.step_seconds or 0:.2f} s step, at least {self.stallwatch.min_s:g} s); "
                f"{who or 'every rank still answers, so one may be deadlocked'}; ending the attempt")
        print(f"hpc-ddp: error: rank {self.rank}: {line}", file=sys.stderr, flush=True)
        if alone:
            first = True
        elif answer:  # the store answers: the first rank to claim writes the record
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
        """A stop near the job's end time is the time limit; a stop `hpc-ddp cancel` recorded for this job
        is a cancel; any other is a preemption (or a rehearsal)."""
        if self._cancelled():
            return "cancelled"
        if self.deadline is None:
            return "preempted"
        near = max(self.signal_lead, self._lead()) + 90  # Slurm may signal up to 60 s early
        return "time_limit" if self.deadline - time.time() <= near else "preempted"

    def _cancelled(self) -> bool:
        """`hpc-ddp cancel` of a local or srun run records its "cancelled" event before it signals the ranks
        (issue 42: the stop line called a cancel "SIGTERM, preempted"). Read once, at the stop."""
        try:
            records = read_jsonl(RunDir(self.run_dir).events)
        except (OSError, ValueError, HpcDdpError):  # unreadable records: not a cancel we can tell of
            return False
        job = self.env.job_id
        return job is not None and any(isinstance(r, dict) and r.get("event") == "cancelled" and
                                       str(r.get("job_id")) == str(job) for r in records)

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
        """The final checkpoint and the "finish" record: the run is complete (step() after it is an error)."""
        self._drain()
        path = self.save("final")
        self._finished = True
        if self.stallwatch is not None:
            self.stallwatch.stop()   # the run is complete: no step will come
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

