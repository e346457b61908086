"""The built-in DDP trainer: `python -m hpc_ddp.train RUN_DIR/spec.json` on every rank (the per-rank
runner starts it for job files with a [train] table), or `hpc-ddp train JOB.toml` directly.

One loop over small parts: data (`data`), model (`models`), checkpoints (`checkpoint`), stop flag
(`stopping`), records (`events`). Every rank's loss, stop flag and "checkpoint due" flag for a step
ride on DDP's last gradient bucket (`reduce`), so all ranks log the same loss and stop or save at the
same step without a second synchronisation per step. A stop (warning signal, SIGTERM) saves a
checkpoint at that step and exits with REQUEUE_EXIT_CODE; the next attempt resumes from the same sample
with the same RNG streams, so on CPU the resumed run ends bitwise identical to an uninterrupted one.

Rehearsal knobs (environment): HPC_DDP_FAULT_STOP_AT=N[,M...] acts as if a stop signal arrived after step N;
HPC_DDP_FAULT_KILL_AT=N[:R] SIGKILLs rank R (default 0) after step N (no checkpoint, like a node failure);
HPC_DDP_FAULT_HANG_AT=N[:R] SIGSTOPs rank R after step N (a hung rank); HPC_DDP_FAULT_NO_JOIN=R keeps
rank R from ever joining the rendezvous (a rank that never starts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import rendezvous
from .checkpoint import CheckpointManager, Loaded, state_sha256
from .data import build_data, shutdown_workers
from .deadline import job_deadline, stop_lead
from .distenv import DistEnv, from_environ
from .errors import HpcDdpError, UserError
from .events import JsonLines
from .exitcodes import REQUEUE_EXIT_CODE
from .models import build_model
from .reduce import StepFlags, flags_hook
from .spec import JobSpec
from .stopping import StopFlag
from .trainconfig import FINGERPRINT_FIELDS, TrainConfig

__all__ = ["run", "main", "Progress"]


class IncompatibleResume(UserError):
    """The checkpoint was made with settings that this run changes."""


@dataclasses.dataclass
class Progress:
    step: int = 0               # optimizer steps done
    epoch: int = 0
    batch_in_epoch: int = 0     # micro-batches of this epoch already consumed, per rank
    restarts: int = 0           # resumes from a checkpoint so far
    samples: int = 0


@dataclasses.dataclass
class Context:
    env: DistEnv
    device: torch.device
    distributed: bool
    store: Any = None        # the rendezvous store (rank 0 hosts it: keep it alive)
    heartbeat: Any = None

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0


def fingerprint(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    return {**{f: getattr(cfg, f) for f in FINGERPRINT_FIELDS}, "world_size": world_size}


def _setup(env: DistEnv, spec: JobSpec) -> Context:
    backend = os.environ.get("BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and torch.cuda.is_available():
        # With gpu_bind="rank" the runner left this rank only its own GPU(s): the first is ours. With
        # "node" every rank sees the node's GPUs, one per local rank.
        shared = spec.gpu_bind == "node" and torch.cuda.device_count() >= env.local_world_size
        index = env.local_rank if shared else 0
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")
    ctx = Context(env, device, env.world_size > 1)
    if ctx.distributed:
        _fault_before_join(env)
        # Our own store: a bounded join that names missing ranks, then the process group on top of it.
        ctx.store = rendezvous.join(env, timeout_s=spec.rendezvous_timeout)
        rendezvous.health_check(ctx.store, env, device, timeout_s=spec.rendezvous_timeout, connect=lambda: (
            dist.init_process_group(backend, store=dist.PrefixStore("pg", ctx.store), rank=env.rank,
                                    world_size=env.world_size, timeout=timedelta(seconds=spec.collective_timeout))))
        ctx.heartbeat = rendezvous.Heartbeat(env).start()
    return ctx


def _fault_before_join(env: DistEnv) -> None:
    """HPC_DDP_FAULT_NO_JOIN=R: rank R hangs before the rendezvous (a rank that never starts)."""
    if os.environ.get("HPC_DDP_FAULT_NO_JOIN") == str(env.rank):
        time.sleep(10**6)


def _rng_state() -> dict[str, Any]:
    """This process's RNG streams as tensors and plain numbers (loadable with weights_only=True)."""
    version, keys, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state = {"python": {"version": version, "keys": torch.tensor(keys, dtype=torch.int64), "gauss": gauss},
             "numpy": {"keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                       "has_gauss": int(np_has_gauss), "cached": float(np_cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(k) for k in py["keys"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(("MT19937", npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _schedule(cfg: TrainConfig, total_steps: int):
    def factor(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


class Trainer:
    def __init__(self, cfg: TrainConfig, ctx: Context, run_dir: Path, stop: StopFlag, signal_lead: float = 120):
        self.cfg, self.ctx, self.run_dir, self.stop = cfg, ctx, run_dir, stop
        self.signal_lead = signal_lead
        self.deadline = job_deadline(os.environ) if ctx.is_main else None
        self.started = time.time()
        self.step_seconds: float | None = None
        self._bar_open = False
        rank, world = ctx.env.rank, ctx.env.world_size
        torch.manual_seed(cfg.seed + rank)
        random.seed(cfg.seed + rank)
        np.random.seed(cfg.seed + rank)
        self.data = build_data(cfg, rank=rank, world_size=world, pin_memory=ctx.device.type == "cuda")
        if self.data.root and cfg.data_dir and str(self.data.root) != cfg.data_dir:
            self.log(f"hpc-ddp: reading the staged copy {self.data.root} of {cfg.data_dir}")
        self.steps_per_epoch = self.data.micro_batches_per_epoch // cfg.grad_accum
        total = self.steps_per_epoch * cfg.epochs
        self.total_steps = min(total, cfg.max_steps) if cfg.max_steps else total
        self.flags: StepFlags | None = None   # set by _model when DDP carries the step's flags
        self.sent: torch.Tensor | None = None
        self.model = self._model()
        self.optimizer = self._optimizer()
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _schedule(cfg, self.total_steps))
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "fp16")
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self.checkpoints = CheckpointManager(run_dir / "checkpoints", keep=cfg.keep_checkpoints, log=self.log)
        self.events = JsonLines(run_dir / "events.jsonl", enabled=ctx.is_main)
        self.metrics = JsonLines(run_dir / "metrics.jsonl", enabled=ctx.is_main)
        self.progress = Progress()
        self.last_save = time.monotonic()
        self.save_seconds: float | None = None

    def log(self, message: str) -> None:
        if self.ctx.is_main:
            if self._bar_open:  # finish the progress bar's line first
                print(file=sys.stdout, flush=True)
                self._bar_open = False
            print(message, file=sys.stderr, flush=True)

    # ---- building ----

    def _model(self) -> nn.Module:
        cfg, ctx = self.cfg, self.ctx
        model = build_model(cfg.model, num_classes=self.data.num_classes, in_channels=self.data.in_channels,
                            image_size=self.data.image_size).to(ctx.device)
        if cfg.sync_bn and ctx.distributed:
            if ctx.device.type == "cuda":
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
            else:
                self.log("hpc-ddp: sync_bn needs GPUs (SyncBatchNorm has no CPU kernel); using plain BatchNorm")
        if ctx.distributed:
            model = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
            if ctx.device.type == "cpu":
                # See reduce.py: the step's flags ride on the gradients, and rank-order sums give exact
                # resume. Not on GPUs yet: NCCL keeps DDP's built-in all-reduce until the hook is measured there.
                self.flags = StepFlags(ordered=ctx.env.world_size > 2)
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

    # ---- checkpoints ----

    def save(self, reason: str) -> None:
        started = time.monotonic()
        rng = [None] * self.ctx.env.world_size
        if self.ctx.distributed:
            dist.all_gather_object(rng, _rng_state())
        else:
            rng = [_rng_state()]
        if self.ctx.is_main:
            p = self.progress
            state = {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                     "progress": dataclasses.asdict(p), "rng": rng}
            model_state = self.module.state_dict()
            meta = {"epoch": p.epoch, "batch_in_epoch": p.batch_in_epoch, "reason": reason,
                    "model_sha256": state_sha256(model_state),
                    "fingerprint": fingerprint(self.cfg, self.ctx.env.world_size)}
            path = self.checkpoints.save(p.step, {"model.pt": model_state,
                                                  "optimizer.pt": self.optimizer.state_dict(),
                                                  "train_state.pt": state}, meta)
            self.save_seconds = time.monotonic() - started
            self.events.write({"event": "checkpoint", "step": p.step, "epoch": p.epoch, "reason": reason,
                               "path": str(path), "seconds": round(self.save_seconds, 3)})
        if self.ctx.distributed:
            dist.barrier()  # nobody exits or goes on before the checkpoint is durable
        self.last_save = time.monotonic()

    def resume(self) -> bool:
        loaded = self.checkpoints.load_latest()
        if loaded is None:
            return False
        self._check_compatible(loaded)
        self.module.load_state_dict(loaded.payloads["model.pt"])
        self.optimizer.load_state_dict(loaded.payloads["optimizer.pt"])
        state = loaded.payloads["train_state.pt"]
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.progress = Progress(**state["progress"])
        self.progress.restarts += 1
        _set_rng_state(state["rng"][self.ctx.env.rank])
        self.log(f"hpc-ddp: resumed from {loaded.path} (step {self.progress.step}, epoch {self.progress.epoch}, "
                 f"batch {self.progress.batch_in_epoch} of the epoch)")
        self.events.write({"event": "resume", "step": self.progress.step, "epoch": self.progress.epoch,
                           "batch_in_epoch": self.progress.batch_in_epoch, "path": str(loaded.path),
                           "restarts": self.progress.restarts})
        return True

    def _check_compatible(self, loaded: Loaded) -> None:
        saved = loaded.manifest.get("fingerprint") or {}
        now = fingerprint(self.cfg, self.ctx.env.world_size)
        changed = [f"{k}: checkpoint {saved.get(k)!r}, now {now[k]!r}" for k in now if saved.get(k) != now[k]]
        if changed:
            raise IncompatibleResume(
                f"cannot resume from {loaded.path}: the run changed {'; '.join(changed)}",
                hint="restore those settings, or start afresh with another --run-dir")

    # ---- the loop ----

    def fit(self) -> int:
        resumed = self.resume()
        if not resumed:
            self.events.write({"event": "start", "step": 0, "total_steps": self.total_steps,
                               "world_size": self.ctx.env.world_size, "job_id": self.ctx.env.job_id})
        self._check_handlers()
        while self.progress.step < self.total_steps:
            outcome = self._epoch()
            if outcome is not None:
                return outcome
        self.save("final")
        self.events.write({"event": "finish", "step": self.progress.step, "epoch": self.progress.epoch})
        self.log(f"hpc-ddp: training finished at step {self.progress.step}; checkpoints in {self.checkpoints.root}")
        return 0

    def _epoch(self) -> int | None:
        p, cfg = self.progress, self.cfg
        self.data.sampler.set_position(p.epoch, p.batch_in_epoch * cfg.batch_size)
        self.model.train()
        steps_left = min(self.steps_per_epoch - p.batch_in_epoch // cfg.grad_accum, self.total_steps - p.step)
        batches = iter(self.data.train)
        window = (time.monotonic(), p.step)
        for _ in range(steps_left):
            step_started = time.monotonic()
            self._step(batches)
            self._time_step(time.monotonic() - step_started)
            p.step += 1
            p.batch_in_epoch += cfg.grad_accum
            p.samples += cfg.batch_size * cfg.grad_accum * self.ctx.env.world_size
            self._fault_injection()
            mean_loss, stop, due = self._agree()
            window = self._record(mean_loss, window)
            if stop:
                return self._stop()
            if due:
                self.save("periodic")
        if p.batch_in_epoch // cfg.grad_accum >= self.steps_per_epoch:
            self._end_epoch()
        return None

    def _step(self, batches) -> None:
        cfg, total = self.cfg, 0.0
        for micro in range(cfg.grad_accum):
            x, y = next(batches)
            x, y = x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)
            last = micro == cfg.grad_accum - 1
            sync = contextlib.nullcontext() if last or not isinstance(self.model, DDP) else self.model.no_sync()
            with sync:
                with torch.autocast(self.ctx.device.type, dtype=self.autocast_dtype or torch.float32,
                                    enabled=self.autocast_dtype is not None):
                    loss = nn.functional.cross_entropy(self.model(x), y) / cfg.grad_accum
                total += loss.item()
                if last:
                    self._send_flags(total)
                self.scaler.scale(loss).backward()
        if cfg.clip_grad:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), cfg.clip_grad)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _time_step(self, seconds: float) -> None:
        self.step_seconds = seconds if self.step_seconds is None else 0.9 * self.step_seconds + 0.1 * seconds

    def _lead(self) -> float:
        lead = stop_lead(self.save_seconds, self.step_seconds, self.cfg.stop_lead_seconds)
        if self.deadline is not None and not self.cfg.stop_lead_seconds:
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

    def _send_flags(self, loss: float) -> None:
        """This rank's view of the step about to complete: its loss, a stop request, a checkpoint due.
        Set before the synchronising backward, which carries them to the other ranks (reduce.py)."""
        cfg, step = self.cfg, self.progress.step + 1
        self._check_deadline()
        if str(step) in os.environ.get("HPC_DDP_FAULT_STOP_AT", "").split(","):
            self.stop.request("HPC_DDP_FAULT_STOP_AT")  # as if the signal came during this step
        due = (cfg.checkpoint_every_steps and step % cfg.checkpoint_every_steps == 0) or (
            cfg.checkpoint_every_minutes and self.ctx.is_main
            and time.monotonic() - self.last_save >= 60 * cfg.checkpoint_every_minutes)
        self.sent = torch.tensor([loss, float(self.stop.requested), float(bool(due))], dtype=torch.float64,
                                 device=self.ctx.device)
        if self.flags is not None:
            self.flags.outgoing, self.flags.incoming = self.sent, None

    def _agree(self) -> tuple[float, bool, bool]:
        """Every rank's flags for the step just done, summed: mean loss, anyone asked to stop, a periodic
        checkpoint is due. They came with the gradients; a separate all-reduce only if they could not."""
        summed = self.sent
        if self.ctx.distributed:
            summed = self.flags.incoming if self.flags is not None else None
            if summed is None:
                summed = self.sent.clone()
                dist.all_reduce(summed)
        values = summed.tolist()
        return values[0] / self.ctx.env.world_size, values[1] > 0, values[2] > 0

    def _record(self, loss: float, window: tuple[float, int]) -> tuple[float, int]:
        p, cfg = self.progress, self.cfg
        if p.step % cfg.log_every and p.step != self.total_steps:
            return window
        started, first_step = window
        now = time.monotonic()
        per_step = cfg.batch_size * cfg.grad_accum * self.ctx.env.world_size
        rate = (p.step - first_step) * per_step / max(now - started, 1e-9)
        lr = self.scheduler.get_last_lr()[0]
        self.metrics.write({"step": p.step, "epoch": p.epoch, "loss": loss, "lr": lr, "samples_per_s": round(rate, 2),
                            "restarts": p.restarts})
        if self.ctx.is_main:
            line = (f"step {p.step}/{self.total_steps}  epoch {p.epoch + 1}/{cfg.epochs}  loss {loss:.4f}  "
                    f"lr {lr:.4g}  {rate:,.0f} samples/s")
            tty = sys.stdout.isatty()
            print(f"\r{line}" if tty else line, end="" if tty else "\n", flush=True)
            self._bar_open = tty
        return now, p.step

    def _stop(self) -> int:
        why = self.stop.received or "a stop request on another rank"
        cause = self._stop_cause()
        self.events.write({"event": "signal", "signal": why, "cause": cause, "step": self.progress.step,
                           "lead_s": round(self._lead(), 1)})
        self.log(f"hpc-ddp: stop requested ({why}, {cause.replace('_', ' ')}); "
                 f"checkpointing at step {self.progress.step}")
        self.save("stop")
        self.events.write({"event": "requeue_requested", "step": self.progress.step,
                           "exit_code": REQUEUE_EXIT_CODE})
        return REQUEUE_EXIT_CODE

    def _end_epoch(self) -> None:
        p = self.progress
        results = self.evaluate() if self.data.eval is not None else {}
        if results:
            self.metrics.write({"step": p.step, "epoch": p.epoch, **results})
            self.log(f"hpc-ddp: epoch {p.epoch + 1} eval loss {results['eval_loss']:.4f} "
                     f"accuracy {results['eval_acc']:.2%}")
        p.epoch += 1
        p.batch_in_epoch = 0

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        module = self.module  # not the DDP wrapper: ranks may see different numbers of eval batches
        module.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        for x, y in self.data.eval:
            x, y = x.to(self.ctx.device), y.to(self.ctx.device)
            out = module(x).float()
            totals += torch.tensor([nn.functional.cross_entropy(out, y, reduction="sum").item(),
                                    (out.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64,
                                   device=self.ctx.device)
        if self.ctx.distributed:
            dist.all_reduce(totals)
        module.train()
        loss, correct, count = totals.tolist()
        return {"eval_loss": loss / max(count, 1), "eval_acc": correct / max(count, 1), "eval_samples": int(count)}

    def close(self) -> None:
        shutdown_workers(self.data.train)
        shutdown_workers(self.data.eval)

    def _check_handlers(self) -> None:
        lost = self.stop.still_installed()
        if lost:
            self.log(f"hpc-ddp: warning: the handler for SIG{', SIG'.join(lost)} was replaced after start-up "
                     "(by a communication library?); stop requests on it will not checkpoint")

    def _fault_injection(self) -> None:
        step, rank = self.progress.step, self.ctx.env.rank
        for knob, sig in (("HPC_DDP_FAULT_KILL_AT", signal.SIGKILL), ("HPC_DDP_FAULT_HANG_AT", signal.SIGSTOP)):
            at, _, who = os.environ.get(knob, "").partition(":")
            if at == str(step) and rank == int(who or 0):
                os.kill(os.getpid(), sig)


def run(spec: JobSpec, run_dir: Path, env: DistEnv | None = None) -> int:
    """Train `spec.train` in this process (one rank); returns the exit code."""
    if spec.train is None:
        raise HpcDdpError("this job has no [train] table; the built-in trainer has nothing to do")
    stop = StopFlag((spec.signal, "TERM")).install()
    ctx = _setup(env or from_environ(os.environ, pid=os.getpid()), spec)
    trainer, why = None, "finished"
    try:
        trainer = Trainer(spec.train, ctx, run_dir, stop, signal_lead=spec.signal_lead)
        return trainer.fit()
    except (dist.DistError, RuntimeError) as exc:
        # A failed collective usually means a peer is gone: name it rather than show a gloo/NCCL trace.
        lost = rendezvous.explain_failure(ctx.store, ctx.env) if ctx.distributed else None
        if lost is None:
            why = _summary(exc)
            raise
        why = rendezvous.LEFT_AFTER_OTHERS
        raise rendezvous.PeerLost(f"rank {ctx.env.rank}: {lost}; stopping ({_summary(exc)[:200]})",
                                  hint="see that rank's log (hpc-ddp logs JOB --rank N)") from None
    except BaseException as exc:
        why = _summary(exc)
        raise
    finally:
        rendezvous.mark_left(ctx.store, ctx.env, why)  # before the heartbeat stops: see mark_left
        if trainer is not None:
            trainer.close()
        if ctx.heartbeat is not None:
            ctx.heartbeat.stop()
        if ctx.distributed:
            rendezvous.leave()


def _summary(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def main(argv: list[str] | None = None) -> None:
    from .runner import load_spec

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m hpc_ddp.train RUN_DIR/spec.json")
    spec_path = Path(args[0]).resolve()
    try:
        code = run(load_spec(spec_path), spec_path.parent)
    except HpcDdpError as exc:
        print(f"hpc-ddp train: error: {exc}", file=sys.stderr, flush=True)
        code = exc.exit_code
    except Exception:  # noqa: BLE001 - report it, then leave at once (below)
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter shutdown: a loader worker or communication thread stuck after a failure
    # must not keep a rank (and so the whole job) alive.
    os._exit(code)


if __name__ == "__main__":
    main()
