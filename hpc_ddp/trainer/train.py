"""The built-in DDP trainer: `python -m hpc_ddp.trainer.train RUN_DIR/spec.json` on every rank (the per-rank
runner starts it for job files with a [train] table), or `hpc-ddp train JOB.toml` directly.

One loop over small parts: data (`data`), model (`models`), checkpoints (`checkpoint`), stop flag
(`stopping`), records (`events`). Every rank's loss, stop flag and "checkpoint due" flag (rank 0's
clock; saves every N steps need no agreement) ride on DDP's last gradient bucket on CPU (`reduce`), so
all ranks log the same loss and stop or save at the same step without a second synchronisation per step;
on GPUs one small all-reduce carries them and `Session.step()` reads them a step late (`lagged`). A stop
(warning signal, SIGTERM) saves a checkpoint at that step and exits with REQUEUE_EXIT_CODE; the next
attempt resumes from the same sample with the same RNG streams, so on CPU the resumed run ends bitwise
identical to an uninterrupted one.

Rehearsal knobs (environment): HPC_DDP_FAULT_STOP_AT=N[,M...] acts as if a stop signal arrived after step N;
HPC_DDP_FAULT_KILL_AT=N[:R] SIGKILLs rank R (default 0) after step N (no checkpoint, like a node failure);
HPC_DDP_FAULT_HANG_AT=N[:R] SIGSTOPs rank R after step N (a hung rank); HPC_DDP_FAULT_NO_JOIN=R keeps
rank R from ever joining the rendezvous (a rank that never starts).
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_ddp.common.errors import HpcDdpError, report
from hpc_ddp.common.exitcodes import REQUEUE_EXIT_CODE
from hpc_ddp.data.loaders import build_data, device_path_fits, shutdown_workers, worker_niceness
from hpc_ddp.spec.jobspec import JobSpec
from hpc_ddp.spec.trainconfig import FINGERPRINT_FIELDS, TOKEN_FINGERPRINT_FIELDS, TrainConfig
from hpc_ddp.trainer.models import build_model
from hpc_ddp.trainer.reduce import StepFlags, flags_hook
from hpc_ddp.trainer.session import IncompatibleResume, Progress, Session
from hpc_ddp.trainer.sharded import shard_model, state_bytes
from hpc_ddp.trainer.speed import COMPILE_CACHE, Speed, decide

__all__ = ["run", "main", "Progress", "IncompatibleResume", "Trainer"]


def fingerprint(cfg: TrainConfig) -> dict[str, Any]:
    extra = TOKEN_FINGERPRINT_FIELDS if cfg.dataset == "tokens" else ()
    return {f: getattr(cfg, f) for f in (*FINGERPRINT_FIELDS, *extra)}


def _schedule(cfg: TrainConfig, total_steps: int):
    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


class _Schedules:
    """The scheduler and the GradScaler as one tracked state (the checkpoint's train_state.pt)."""

    def __init__(self, scheduler, scaler):
        self.scheduler, self.scaler = scheduler, scaler

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])


class Trainer:
    """The built-in loop, on the public Session API (session.py): the session owns the rendezvous, the
    stop flag and deadline, checkpoints, RNG, progress and records; this owns data, model and the step."""

    def __init__(self, cfg: TrainConfig, session: Session):
        self.cfg, self.session = cfg, session
        rank, world = session.rank, session.world_size
        torch.manual_seed(cfg.seed + rank)
        random.seed(cfg.seed + rank)
        np.random.seed(cfg.seed + rank)
        # Decided once the data and model are known (trainer/speed.py); the data path first, from a draft.
        gpu = session.device.type == "cuda"
        fits = device_path_fits(cfg) if gpu or cfg.data_path == "device" else (False, False)
        draft = self._speed(convolutional=True, total_steps=0, fits=fits)
        self.data = build_data(cfg, rank=rank, world_size=world, pin_memory=gpu,
                               worker_niceness=worker_niceness(session.device.type), data_path=draft.data_path,
                               device=session.device)
        if self.data.root and cfg.data_dir and str(self.data.root) != cfg.data_dir:
            session.log(f"hpc-ddp: reading the staged copy {self.data.root} of {cfg.data_dir}")
        # The accumulation from now on: cfg.grad_accum, or what keeps the global batch on resuming on another size.
        self.grad_accum = session.accumulation(cfg.grad_accum, batch_size=cfg.batch_size)
        split = session._split
        # An uneven split (a resume on a size the global batch does not divide, data.elastic): this rank's
        # own micro-batch, its loss weighted by its share; an epoch is floor(N / G) steps.
        self.loss_weight = split.loss_weight(rank) if split is not None and not split.even else None
        if self.loss_weight is not None:
            _rank_batch(self.data.train, session.batch_size())
        self.global_batch = split.global_batch if split is not None else \
            cfg.batch_size * self.grad_accum * session.world_size
        self.steps_per_epoch = self.data.micro_batches_per_epoch // self.grad_accum if self.loss_weight is None \
            else self.data.sampler.size // self.global_batch
        total = self.steps_per_epoch * cfg.epochs
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        self.flags: StepFlags | None = None   # set by _model when DDP carries the step's flags
        self._measured = False                # the memory record, after the first backward
        self.model = self._model()
        convolutional = any(isinstance(m, nn.Conv2d) for m in self.model.modules())
        self.speed = self._speed(convolutional=convolutional, total_steps=self.total_steps, fits=fits)
        chosen = (self.speed.precision, self.speed.data_path, self.speed.channels_last, self.speed.compile)
        if gpu or chosen != ("fp32", "cpu", False, False):  # on CPUs, said only when the job file chose
            session.log(f"hpc-ddp: {self.speed.describe()}" +
                        (f" ({'; '.join(self.speed.notes)})" if self.speed.notes else ""))
        self.forward = self._compiled() if self.speed.compile else self.model
        self.optimizer = self._optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(cfg, self.total_steps))
        self.scaler = torch.amp.GradScaler(session.device.type, enabled=self.speed.precision == "fp16")
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.speed.precision)
        session.track(model=self.module, optimizer=self.optimizer,
                      train_state=_Schedules(self.scheduler, self.scaler))
        session.follow(self.data.sampler, batch_size=cfg.batch_size)
        session.total_steps, session.epochs_total = self.total_steps, cfg.epochs

    @property
    def progress(self) -> Progress:
        return self.session.progress

    # ---- building ----

    def _speed(self, *, convolutional: bool, total_steps: int, fits: tuple[bool, bool]) -> Speed:
        gpu = self.session.device.type == "cuda"
        return decide(self.cfg, device_type=self.session.device.type,
                      bf16_supported=gpu and torch.cuda.is_bf16_supported(), convolutional=convolutional,
                      total_steps=total_steps, native_size=fits[0], jpegs=fits[1])

    def _compiled(self):
        """torch.compile of the (DDP) model, its caches in the run dir: a requeued attempt loads the kernels
        the first one compiled instead of compiling again (a variable the user set is kept)."""
        cache = Path(self.session.run_dir) / COMPILE_CACHE
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "inductor"))
        os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
        return torch.compile(self.model)

    def _model(self) -> nn.Module:
        cfg, session = self.cfg, self.session
        model = build_model(cfg.model, num_classes=self.data.num_classes, in_channels=self.data.in_channels,
                            image_size=self.data.image_size,
                            decoder={"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd}
                            ).to(session.device)
        if session.device.type == "cuda" and cfg.channels_last is not False and \
                any(isinstance(m, nn.Conv2d) for m in model.modules()):
            model = model.to(memory_format=torch.channels_last)  # "auto" or true: decided with the model below
        if cfg.sync_bn and session.distributed:
            if session.device.type == "cuda":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            else:
                session.log("hpc-ddp: sync_bn needs GPUs (SyncBatchNorm has no CPU kernel); using plain BatchNorm")
        if cfg.strategy == "fsdp":  # sharded over the ranks (a world of one too): checkpoints by every rank
            return shard_model(model)
        if session.distributed:
            # gradient_as_bucket_view=True (gradients as views of the all-reduce buckets, zeroed in place)
            # was tried for issue 16 and not kept: no gain measurable above this VM's noise (bench/README.md).
            model = DDP(model, device_ids=session.device_ids)
            if session.device.type == "cpu":
                # See reduce.py: the step's flags ride on the gradients, and rank-order sums give exact
                # resume. Not on GPUs yet: NCCL keeps DDP's built-in all-reduce until the hook is measured there.
                self.flags = StepFlags(ordered=session.world_size > 2)
                model.register_comm_hook(self.flags, flags_hook)
        return model

    def _optimizer(self) -> torch.optim.Optimizer:
        cfg, params = self.cfg, self.model.parameters()
        if cfg.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)

    @property
    def module(self) -> nn.Module:
        return self.model.module if isinstance(self.model, DDP) else self.model

    # ---- the loop ----

    def fit(self) -> int:
        self.session.resume(total_steps=self.total_steps)
        self.session.warn_if_handlers_replaced()
        self._start_eval_workers()
        for _epoch in self.session.epochs(self.cfg.epochs):
            if self._epoch() or self.session.settle():  # settle: a GPU's last-step stop, before evaluating
                return REQUEUE_EXIT_CODE
            if self.progress.step >= self.total_steps and \
                    self.progress.batch_in_epoch // self.grad_accum < self.steps_per_epoch:
                break  # max_steps ends training mid-epoch: no end-of-epoch evaluation
            self._end_epoch()
        self.session.finish()
        return 0

    def _start_eval_workers(self) -> None:
        """Fork the evaluation loader's (persistent) workers now, as the training loader's are, before the
        first step, not at the first epoch's end. From the first step on, gloo's threads run the comm hook's
        Python callbacks, and CPython before 3.11.8 and 3.12 can hang a child forked while such a thread
        takes the interpreter's thread-state lock (CPython gh-112275): its rank then waited for the first
        evaluation batch forever. Before the first step those threads are idle."""
        if self.data.eval is not None and self.data.eval.persistent_workers:
            iter(self.data.eval)  # kept by the loader; the first evaluation resets it, as every later one does

    def _epoch(self) -> bool:
        """One epoch from the resumed batch on; True when the ranks stopped (checkpointed) in it."""
        p = self.progress
        self.model.train()
        steps_left = min(self.steps_per_epoch - p.batch_in_epoch // self.grad_accum, self.total_steps - p.step)
        if steps_left <= 0:
            return False
        batches = iter(self.data.train)
        samples = self.global_batch
        for _ in range(steps_left):
            self._step(batches)
            summed = self.flags.incoming if self.flags is not None else None
            if self.session.step(self._loss, batches=self.grad_accum, samples=samples, summed=summed,
                                 lr=self.scheduler.get_last_lr()[0]):
                return True
        return False

    def _step(self, batches) -> None:
        cfg, total = self.cfg, 0.0
        # On GPUs the loss stays on the device (float64, as the CPU's Python floats): reading it per
        # micro-step would make the host wait for each forward. The flags carry it; step() reads them a step late.
        on_device = self.session.device.type != "cpu"
        for micro in range(self.grad_accum):
            x, y = next(batches)
            x, y = x.to(self.session.device, non_blocking=True), y.to(self.session.device, non_blocking=True)
            if self.speed.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)  # a no-op for the device path's batches
            last = micro == self.grad_accum - 1
            if self.cfg.strategy == "fsdp":  # reduce-scatter the gradients once, at the last micro-step
                self.model.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext() if last or not isinstance(self.model, DDP) else self.model.no_sync()
            with sync:
                with torch.autocast(self.session.device.type, dtype=self.autocast_dtype or torch.float32,
                                    enabled=self.autocast_dtype is not None):
                    loss = nn.functional.cross_entropy(self.forward(x), y)
                    loss = loss / self.grad_accum if self.loss_weight is None else loss * self.loss_weight
                total = total + (loss.detach().double() if on_device else loss.item())
                if last:
                    # This rank's flags, set before the synchronising backward that carries them (reduce.py).
                    sent = self.session.flags(total)
                    if self.flags is not None:
                        self.flags.outgoing, self.flags.incoming = sent, None
                self.scaler.scale(loss).backward()
        self._loss = total
        if cfg.clip_grad:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if not self._measured:
            self._record_memory()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _end_epoch(self) -> None:
        with self.session.busy("evaluating"):  # not a step: the stall watch does not count it
            results = self.evaluate() if self.data.eval is not None else {}
        if results:
            self.session.log_metrics(**results)
            self.session.log(f"hpc-ddp: epoch {self.progress.epoch + 1} eval loss {results['eval_loss']:.4f} "
                             f"accuracy {results['eval_acc']:.2%}")

    def _record_memory(self) -> None:
        """Once, after the first optimizer step (gradients and optimizer state exist then): what this rank holds,
        in the log and as a `memory` record (`status` shows it)."""
        self._measured = True
        held = state_bytes(self.module, self.optimizer)
        record = {"event": "memory", "strategy": self.cfg.strategy, "world_size": self.session.world_size,
                  **{f"{k}_bytes": v for k, v in held.items()}}
        if self.session.device.type == "cuda":
            record["peak_gpu_bytes"] = torch.cuda.max_memory_allocated(self.session.device)
        self.session.events.write(record)
        how = f"sharded over {self.session.world_size} ranks" if self.cfg.strategy == "fsdp" else "a full copy"
        self.session.log(f"hpc-ddp: memory per rank: {held['total'] / 2**20:,.1f} MiB of weights, gradients and "
                         f"optimizer state ({how})")

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        module, device = self.module, self.session.device  # not DDP: ranks may see different eval batch counts
        module.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=device)
        for x, y in self._eval_batches():
            x, y = x.to(device), y.to(device)
            out = module(x).float()
            totals += torch.tensor([nn.functional.cross_entropy(out, y, reduction="sum").item(),
                                    (out.argmax(1) == y).sum().item(), y.numel()], dtype=torch.float64,
                                   device=device)
        if self.session.distributed:
            torch.distributed.all_reduce(totals)
        module.train()
        loss, correct, count = totals.tolist()
        return {"eval_loss": loss / max(count, 1), "eval_acc": correct / max(count, 1), "eval_samples": int(count)}

    def _eval_batches(self):
        """The evaluation batches. A sharded model's forward is a collective (each block's weights are
        gathered from every rank), so each rank takes as many batches as the rank with fewest has."""
        if self.cfg.strategy != "fsdp" or not self.session.distributed:
            yield from self.data.eval
            return
        count = torch.tensor([len(self.data.eval)], device=self.session.device)
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN)
        for _, batch in zip(range(int(count.item())), self.data.eval):
            yield batch

    def close(self) -> None:
        shutdown_workers(self.data.train)
        shutdown_workers(self.data.eval)


def _rank_batch(loader, batch_size: int) -> None:
    """Have the training loader yield this rank's micro-batch of an uneven split (its BatchSampler reads
    the size at each epoch's iterator); the device path's batches wrap a loader of their own."""
    loader = loader if hasattr(loader, "batch_sampler") else getattr(loader, "loader", loader)  # device path
    batches = getattr(loader, "batch_sampler", None)
    if batches is None or not hasattr(batches, "batch_size"):
        raise IncompatibleResume(
            "cannot resume on this number of ranks: its share of the global batch is uneven, and this data path "
            "cannot change its batch size",
            hint='set data_path = "cpu" in [train] for this resume, or resume on a number of ranks the global '
                 "batch divides")
    batches.batch_size = batch_size


def run(spec: JobSpec, run_dir: Path, env=None) -> int:
    """Train `spec.train` in this process (one rank); returns the exit code."""
    cfg = spec.train
    if cfg is None:
        raise HpcDdpError("this job has no [train] table; the built-in trainer has nothing to do")
    session = Session(run_dir, checkpoint_every_steps=cfg.checkpoint_every_steps,
                      checkpoint_every_minutes=cfg.checkpoint_every_minutes, keep=cfg.keep_checkpoints,
                      log_every=cfg.log_every, fingerprint=fingerprint(cfg), stop_lead_seconds=cfg.stop_lead_seconds,
                      exit_on_stop=False, env=env, async_checkpoint=cfg.async_checkpoint, loggers=cfg.loggers)
    with session.setup():
        trainer = Trainer(cfg, session)
        try:
            return trainer.fit()
        finally:
            trainer.close()


def _summary(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def main(argv: list[str] | None = None) -> None:
    from hpc_ddp.spec.jobspec import load_spec

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m hpc_ddp.trainer.train RUN_DIR/spec.json")
    spec_path = Path(args[0]).resolve()
    try:
        code = run(load_spec(spec_path), spec_path.parent)
    except Exception as exc:  # noqa: BLE001 - report it, then leave at once (below)
        code = report(exc, "hpc-ddp train", traceback_for_bugs=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter shutdown: a loader worker or communication thread stuck after a failure
    # must not keep a rank (and so the whole job) alive.
    os._exit(code)


if __name__ == "__main__":
    main()
