"""The experiment loggers a session feeds besides metrics.jsonl: TensorBoard (torch.utils.tensorboard,
`pip install 'hpc-ddp[tensorboard]'`) and Weights & Biases (wandb, where installed). Rank 0 only.

A requeued job continues the same run in both: W&B through the run id the runner exports to every
rank (HPC_DDP_RUN_ID, WANDB_RUN_ID, WANDB_RESUME=allow; offline unless WANDB_MODE says otherwise,
since compute nodes often have no internet), TensorBoard through one log dir per run dir and
`purge_step`, which drops what an earlier attempt logged past the step this one resumed from (the
steps it redoes). A logger that is not installed is said once and skipped: training goes on.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hpc_ddp.trainer.sessionbase import UsageError

__all__ = ["Loggers", "KNOWN", "check_names", "numeric"]

KNOWN = ("tensorboard", "wandb")


def check_names(names: Any) -> tuple[str, ...]:
    """`loggers=` as a tuple of known names, or a UsageError naming the ones that are not (on every rank, so
    a typo stops the run at its start wherever it is read)."""
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise UsageError(f"hpc_ddp.start(loggers={names!r}): loggers takes a list of names",
                         hint=f"pass loggers=[...] with any of {', '.join(KNOWN)}")
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        raise UsageError(f"hpc_ddp.start(loggers=...): unknown logger(s) {', '.join(map(repr, unknown))}",
                         hint=f"use any of {', '.join(KNOWN)} (or none)")
    return tuple(names)


def numeric(record: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of a metrics record worth a curve (not its step, epoch or time)."""
    return {k: float(v) for k, v in record.items() if k not in ("step", "epoch", "time")
            and isinstance(v, (int, float)) and not isinstance(v, bool)}


class Loggers:
    def __init__(self, names: Sequence[str], run_dir: Path, log: Callable[[str], None]):
        names = check_names(names)
        self.names, self.run_dir, self.log = list(dict.fromkeys(names)), Path(run_dir), log
        self._tb: Any = None
        self._wandb: Any = None
        self._started = False

    def _start(self, step: int) -> None:
        """At the first record, so TensorBoard's purge_step is the step this attempt resumed near."""
        self._started = True
        if "tensorboard" in self.names:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self.log("hpc-ddp: tensorboard is not installed (pip install 'hpc-ddp[tensorboard]'); "
                         "not logging to TensorBoard")
            else:
                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=step or None)
        if "wandb" in self.names:
            try:
                import wandb
            except ImportError:
                self.log("hpc-ddp: wandb is not installed (pip install wandb); not logging to Weights & Biases")
            else:
                run_id = os.environ.get("WANDB_RUN_ID") or os.environ.get("HPC_DDP_RUN_ID")
                self._wandb = wandb.init(id=run_id, resume=os.environ.get("WANDB_RESUME", "allow"),
                                         project=os.environ.get("WANDB_PROJECT", "hpc-ddp"), dir=str(self.run_dir),
                                         name=self.run_dir.name, mode=os.environ.get("WANDB_MODE", "offline"))

    def write(self, record: Mapping[str, Any]) -> None:
        """One metrics record (what metrics.jsonl got)."""
        if not self.names:
            return
        step = int(record.get("step") or 0)
        if not self._started:
            self._start(step)
        values = numeric(record)
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(values, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._tb = self._wandb = None
