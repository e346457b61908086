"""`hpc-ddp export`: a checkpoint's model as one file `torch.load` reads into the unsharded model, from a
sharded checkpoint (put together by trainer.consolidate) or a DDP one (its model.pt)."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.common.errors import UserError
from hpc_ddp.common.rundir import RunDir
from hpc_ddp.trainer.checkpoint import CheckpointManager, resolve, state_sha256
from hpc_ddp.trainer.checkpointread import load
from hpc_ddp.trainer.consolidate import model_state, read_step

__all__ = ["checkpoint_at", "export_model"]


def checkpoint_at(source: Path, step: int | None) -> Path:
    """The checkpoint `export` reads: `source` itself (a step-N dir), else in it (a run dir or its checkpoints
    dir) the newest that verifies, or the newest of step `step`."""
    if step is None:
        return resolve(source)
    there: list[Path] = []
    for root in (RunDir(source).checkpoints, source):
        there += CheckpointManager(root, log=lambda _m: None).checkpoints()
        found = [p for p in there if read_step(p) == step]
        if found:
            return found[-1]  # step-N-rK: the newer save of that step
    steps = sorted({s for s in map(read_step, there) if s is not None})
    raise UserError(f"no checkpoint of step {step} in {source}",
                    hint=f"the steps there: {', '.join(map(str, steps))}" if steps else
                    "give a run dir that holds a checkpoint")


def export_model(source: Path, to: Path, step: int | None = None) -> dict[str, Any]:
    """Write the model of a checkpoint (sharded or not) as one file `torch.load` reads into the unsharded
    model: its state dict, on the CPU. Never replaces a file: `to` must not exist (it is linked into place,
    which fails where something appeared meanwhile). What was written: path, step, tensors, bytes, sha256."""
    target = checkpoint_at(source, step)
    loaded = load(target, files=("model.pt",))  # every file verified first
    state = model_state(loaded)
    tmp = to.parent / f".{to.name}.hpc-ddp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "xb") as out:
            torch.save(state, out)
            out.flush()
            os.fsync(out.fileno())
        os.link(tmp, to)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return {"path": str(to), "checkpoint": str(target), "step": loaded.step, "tensors": len(state),
            "bytes": to.stat().st_size, "model_sha256": state_sha256(state)}
