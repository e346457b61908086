"""Sharded states: a model sharded with FSDP2 (`fully_shard`) and its optimizers, checkpointed by every rank.

Such a model holds 1/N of its weights, gradients and optimizer state on each of N ranks, so no rank can save
it alone. Every rank writes its own shards with torch.distributed.checkpoint (DCP), into the same temporary
directory checkpoint.CheckpointManager made for this step; the state dicts come from torch's own
`torch.distributed.checkpoint.state_dict` (get/set_model_state_dict, get/set_optimizer_state_dict), and DCP
reshards on load, so a checkpoint of N ranks resumes on M.

The crash-safe protocol is the unsharded one, made collective:
1. rank 0 names the checkpoint and makes its temporary directory (`begin`), and tells every rank;
2. every rank writes its shards there (DCP fsyncs each file) and hashes the files it wrote, `__R_*.distcp`;
3. the hashes are gathered on rank 0, which hashes what no rank claimed (DCP's `.metadata`), writes the
   unsharded payloads (progress, RNG streams, schedulers) and the manifest listing every file with its size
   and sha256, renames the directory into place and points `latest` at it (`commit`);
4. every rank hears the outcome: a save that failed on any rank fails on all, and leaves nothing.

A resume goes through rank 0's list of candidates. For each, every rank checks that every file is there at
its manifest's size and hashes its share of the shards (file i on rank i mod M): the ranks read the
checkpoint once between them, not M times. If any rank finds a file missing or damaged, every rank says why
and tries the previous checkpoint; only one that verifies everywhere is loaded.

Refused in one line each, with the fix: FSDP1 (`FullyShardedDataParallel`) and `ZeroRedundancyOptimizer`
(their state dicts are not DCP's), a sharded model tracked without its optimizer, an optimizer of a
sharded model tracked without the model, a model sharded on some ranks only, and a checkpoint of the
other kind (sharded into unsharded, or the reverse).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpc_ddp.trainer.checkpoint import BeyondSchedule, CheckpointError, CheckpointManager, Loaded
from hpc_ddp.trainer.checkpointread import _load, read_manifest
from hpc_ddp.trainer.consolidate import read_step
from hpc_ddp.trainer.sessionbase import IncompatibleResume, UsageError

__all__ = ["SHARDS_KEY", "Sharded", "agree_on_sharding", "is_sharded_checkpoint", "is_sharded_module", "load_sharded",
           "refuse_unsupported", "save_sharded", "shard_model", "state_bytes", "host_copy"]

SHARDS_KEY = "sharded"   # in the manifest: {"world_size": N, "states": [...]}; absent from unsharded ones
_CHUNK = 8 << 20


def is_sharded_module(obj: Any) -> bool:
    """A module FSDP2 sharded (`fully_shard` on it or on a submodule): some parameter is a DTensor."""
    if not isinstance(obj, nn.Module):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in obj.parameters())


def _sharded_optimizer(obj: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(obj, torch.optim.Optimizer) and any(
        isinstance(p, DTensor) for group in obj.param_groups for p in group["params"])


def refuse_unsupported(name: str, obj: Any) -> None:
    """FSDP1 and ZeroRedundancyOptimizer: one line naming what to use instead."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(obj, FullyShardedDataParallel):
        raise UsageError(f"track({name}=FullyShardedDataParallel(...)): FSDP1 is not supported (its sharded state "
                         "dict is not torch.distributed.checkpoint's, and PyTorch deprecates it)",
                         hint="shard with FSDP2: from torch.distributed.fsdp import fully_shard; fully_shard(block) "
                              "for each block, then fully_shard(model)")
    if isinstance(obj, ZeroRedundancyOptimizer):
        raise UsageError(f"track({name}=ZeroRedundancyOptimizer(...)) is not supported: its state_dict() needs a "
                         "consolidate_state_dict() on every rank first, and it resumes on the same world size only",
                         hint="shard the model with FSDP2 (fully_shard), which shards the optimizer state too, and "
                              "track a plain optimizer of it")


def shard_model(model: nn.Module) -> nn.Module:
    """FSDP2 the built-in trainer's way: `fully_shard` on each block (a transformer's `blocks`; else each
    child module that holds parameters), then on the model, so one block's weights are gathered at a time."""
    from torch.distributed.fsdp import fully_shard

    blocks = list(model.blocks) if isinstance(getattr(model, "blocks", None), nn.ModuleList) else \
        [child for child in model.children() if any(True for _ in child.parameters())]
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank holds of the training state, in bytes: its weights (its shards, for a sharded model),
    as many again for their gradients, and its optimizer state. The figure that FSDP divides by the ranks."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    weights = sum(local(p) for p in model.parameters())
    state = sum(local(v) for per in optimizer.state.values() for v in per.values() if isinstance(v, torch.Tensor))
    return {"weights": weights, "gradients": weights, "optimizer": state, "total": 2 * weights + state}


class Sharded:
    """The tracked states that are sharded, each with how DCP reads and loads it."""

    def __init__(self, tracked: Mapping[str, Any]):
        self.modules = {name: obj for name, obj in tracked.items() if is_sharded_module(obj)}
        self.optimizers: dict[str, tuple[torch.optim.Optimizer, str]] = {}
        owners = {id(p): name for name, module in self.modules.items() for p in module.parameters()}
        for name, obj in tracked.items():
            if not _sharded_optimizer(obj):
                continue
            found = {owners.get(id(p)) for group in obj.param_groups for p in group["params"]}
            if None in found or len(found) != 1:
                raise UsageError(f"track({name}=...): an optimizer of a sharded model, but "
                                 + ("not of one tracked model" if found - {None} else "its model is not tracked"),
                                 hint=f"track the sharded model beside it: run.track(model=model, {name}={name})")
            self.optimizers[name] = (obj, found.pop())
        for name in self.modules:
            if name not in {module for _, module in self.optimizers.values()}:
                raise UsageError(f"track({name}=...): a sharded model (fully_shard) tracked without its optimizer: "
                                 "its shards of the optimizer state would be lost at every resume",
                                 hint=f"track the optimizer too: run.track({name}={name}, optimizer=opt)")

    @property
    def names(self) -> list[str]:
        return [*self.modules, *self.optimizers]

    def __bool__(self) -> bool:
        return bool(self.modules)

    def state(self) -> dict[str, Any]:
        """The DCP state dict: each sharded name -> its sharded state dict (DTensors, this rank's shards)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {name: get_model_state_dict(module) for name, module in self.modules.items()}
        for name, (optimizer, model) in self.optimizers.items():
            state[name] = get_optimizer_state_dict(self.modules[model], optimizer)
        return state

    def load_into(self, state: Mapping[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        for name, module in self.modules.items():
            set_model_state_dict(module, state[name])
        for name, (optimizer, model) in self.optimizers.items():
            set_optimizer_state_dict(self.modules[model], optimizer, state[name])


def agree_on_sharding(sharded: bool, rank: int, world_size: int) -> None:
    """Every rank's model is sharded, or none is (collective): a mix cannot save or load."""
    if world_size <= 1:
        return
    seen: list[Any] = [None] * world_size
    dist.all_gather_object(seen, sharded)
    if len(set(seen)) > 1:
        some = [r for r, s in enumerate(seen) if s]
        others = [r for r, s in enumerate(seen) if not s]
        raise UsageError(f"the tracked model is sharded (fully_shard) on ranks {_ranks(some)} and not on ranks "
                         f"{_ranks(others)}: a checkpoint needs the same model on every rank",
                         hint="call fully_shard(...) on every rank, in the same order")


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8})" if len(ranks) > 8 else "")


def _file_entry(path: Path) -> dict[str, Any]:
    """Size and sha256 of a file this rank wrote, fsynced again (cheap where DCP did) as it is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path} is not a regular file")
        digest, size = hashlib.sha256(), 0
        while chunk := os.read(fd, _CHUNK):
            digest.update(chunk)
            size += len(chunk)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": size, "sha256": digest.hexdigest()}


def _one(gathered: list[Any]) -> str | None:
    return next((g for g in gathered if g), None)


def host_copy(value: Any, into: Any = None) -> Any:
    """A copy of a (sharded) state dict in host memory that training can no longer change: each DTensor's
    local shard copied, with its mesh and placements, so DCP writes it as the same shards. What a background
    save writes from while the loop goes on. `into`: the previous copy, whose write is done: its buffers
    are reused where shapes and dtypes agree (fresh memory costs a page fault a page, as much as the copy)."""
    import copy

    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local().detach()
        if isinstance(into, DTensor) and _fits(into.to_local(), local) and into.placements == value.placements:
            into.to_local().copy_(local)
            return into
        return DTensor.from_local(local.to("cpu", copy=True), value.device_mesh, value.placements, run_check=False,
                                  shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        if isinstance(into, torch.Tensor) and not isinstance(into, DTensor) and _fits(into, value):
            return into.copy_(value.detach())
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {k: host_copy(v, into.get(k) if isinstance(into, Mapping) else None) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        before = into if isinstance(into, (list, tuple)) and len(into) == len(value) else [None] * len(value)
        return type(value)(host_copy(v, b) for v, b in zip(value, before))
    return copy.deepcopy(value)


def _fits(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    return (buffer.shape == source.shape and buffer.dtype == source.dtype and buffer.device.type == "cpu"
            and buffer.is_contiguous() and source.layout == torch.strided)


def save_sharded(manager: CheckpointManager, sharded: Sharded, step: int, payloads: Mapping[str, Any] | None,
                 meta: Mapping[str, Any], rank: int, world_size: int, *, state: Mapping[str, Any] | None = None,
                 group: Any = None) -> Path | None:
    """Collective: every rank writes its shards of checkpoint `step`; rank 0 also the unsharded `payloads`
    (None on the other ranks) and the manifest. Its path on rank 0, None elsewhere; CheckpointError on every
    rank when it failed on any, and then nothing of it is left. `state`: the sharded states to write (a
    `host_copy`, in the background), else read now; `group`: the process group of its collectives (a
    background save's own, beside the loop's)."""
    place: list[Any] = [None]
    if rank == 0:
        try:
            place = [manager.begin(step)]
        except CheckpointError as exc:
            place = [str(exc)]
    dist.broadcast_object_list(place, src=0, group=group)
    if isinstance(place[0], str):
        raise CheckpointError(place[0])
    name, tmp = place[0][0], Path(place[0][1])
    mine: dict[str, Any] = {}
    error = None
    try:
        import torch.distributed.checkpoint as dcp

        dcp.save(sharded.state() if state is None else state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                 process_group=group)
        for entry in sorted(os.listdir(tmp)):
            if entry.startswith(f"__{rank}_"):
                mine[entry] = _file_entry(tmp / entry)
    except Exception as exc:  # noqa: BLE001 - handed to every rank, then raised on each
        error = f"rank {rank}: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, (mine, error), group=group)
    failed = _one([e for _, e in gathered])
    outcome: list[Any] = [None]
    if rank == 0:
        if failed:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = [f"saving checkpoint {name} failed: {failed}"]
        else:
            outcome = [_commit(manager, name, tmp, step, payloads or {}, meta, gathered, world_size, sharded)]
    dist.broadcast_object_list(outcome, src=0, group=group)
    if not isinstance(outcome[0], Path):
        raise CheckpointError(str(outcome[0]))
    return outcome[0] if rank == 0 else None


def _commit(manager: CheckpointManager, name: str, tmp: Path, step: int, payloads: Mapping[str, Any],
            meta: Mapping[str, Any], gathered: list[Any], world_size: int, sharded: Sharded) -> Path | str:
    """Rank 0: the manifest over every rank's files, then into place. A path, or what went wrong."""
    try:
        files: dict[str, Any] = {}
        for theirs, _ in gathered:
            files.update(theirs)
        for entry in sorted(os.listdir(tmp)):  # DCP's .metadata: written by rank 0 as the coordinator
            if entry not in files:
                files[entry] = _file_entry(tmp / entry)
        meta = {**meta, SHARDS_KEY: {"world_size": world_size, "states": sharded.names}}
        return manager.commit(name, tmp, step, payloads, meta, files=files)
    except (CheckpointError, OSError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        return str(exc)


def load_sharded(manager: CheckpointManager, sharded: Sharded, plain: tuple[str, ...], max_step: int | None,
                 rank: int, world_size: int, log: Callable[[str], None]) -> Loaded | None:
    """Collective: the newest checkpoint that verifies on every rank, its sharded states loaded into the
    tracked model and optimizers, the unsharded payloads named `plain` loaded and returned; None: none."""
    listed: list[Any] = [[str(p) for p in manager.candidates()] if rank == 0 else None]
    dist.broadcast_object_list(listed, src=0)
    candidates = [Path(p) for p in listed[0]]
    for path in candidates:
        loaded, error = None, None
        try:
            manifest = read_manifest(path)
            shards = sorted(f for f in manifest["files"] if f not in plain)
            share = set(shards[rank::world_size])
            loaded = _load(path, plain, max_step, name_step=read_step(path), hashed=share | set(plain))
        except BeyondSchedule as exc:
            raise exc.with_traceback(None) from None
        except CheckpointError as exc:
            error = str(exc)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, error)
        if _one(gathered):
            log(f"hpc-ddp: {_one(gathered)}; trying the previous checkpoint")
            continue
        if SHARDS_KEY not in loaded.manifest:
            raise IncompatibleResume(f"cannot resume from {path}: it was saved from an unsharded model (DDP or "
                                     "plain), and this run's model is sharded (fully_shard)",
                                     hint="resume with the model the run saved, or start afresh with another "
                                          "--run-dir")
        held = set((loaded.manifest[SHARDS_KEY] or {}).get("states") or [])
        if not set(sharded.names) <= held:
            raise IncompatibleResume(f"cannot resume from {path}: its sharded states are {sorted(held)}, not "
                                     f"{sorted(set(sharded.names) - held)}",
                                     hint="track() the same names as the run that saved it, or use another --run-dir")
        state = sharded.state()
        try:
            import torch.distributed.checkpoint as dcp

            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
            sharded.load_into(state)
        except Exception as exc:  # noqa: BLE001 - another model's shards: one line, not DCP's traceback
            first = (str(exc).strip().splitlines() or [""])[0].strip()
            raise IncompatibleResume(f"cannot resume from {path}: its sharded states do not fit this run's "
                                     f"({type(exc).__name__}: {first[:200]})",
                                     hint="build and shard the same model as the run that saved it, or start "
                                          "afresh with another --run-dir") from None
        for name in sharded.names:
            loaded.payloads[f"{name}.pt"] = None  # loaded above, through DCP
        return loaded
    if candidates:
        log(f"hpc-ddp: no valid checkpoint among {len(candidates)} in {manager.root}; starting from scratch")
    return None


def is_sharded_checkpoint(manifest: Mapping[str, Any] | None) -> bool:
    """A manifest of a checkpoint written by sharded ranks (DCP files beside the unsharded payloads)."""
    return isinstance(manifest, Mapping) and SHARDS_KEY in manifest
