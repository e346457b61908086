"""One tracked state of a sharded checkpoint (trainer.sharded), put back together in one process: what
`hpc-ddp export` writes and `hpc-ddp inspect` hashes. CPU only, no process group: DCP's own metadata says
each tensor's full shape and dtype, and `dcp.load(..., no_dist=True)` fills full tensors from every rank's
shards. The checkpoint is verified (every file's sha256) before anything is read from it."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from hpc_ddp.trainer.checkpointread import CheckpointError, verify

__all__ = ["consolidated_state", "model_state", "read_step", "sharded_states"]


def sharded_states(manifest: dict[str, Any]) -> list[str]:
    """The names a sharded checkpoint holds in DCP's files (model, optimizer, ...); [] for an unsharded one."""
    held = (manifest.get("sharded") or {}).get("states") if isinstance(manifest.get("sharded"), dict) else None
    return [name for name in held if isinstance(name, str)] if isinstance(held, list) else []


def consolidated_state(path: Path, name: str = "model", verified: bool = False) -> dict[str, torch.Tensor]:
    """The full state dict of `name` (a tracked module) in the sharded checkpoint at `path`, on the CPU, in the
    order the model saved it (its state_dict() order, as `torch.load` of an unsharded model.pt gives)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    manifest = verify(path) if not verified else None
    if manifest is not None and name not in sharded_states(manifest):
        raise CheckpointError(f"checkpoint {path} holds no sharded {name!r} (it holds "
                              f"{sharded_states(manifest) or 'no sharded states'})")
    reader = dcp.FileSystemReader(str(path))
    prefix = f"{name}."
    try:
        metadata = reader.read_metadata()
    except Exception as exc:  # noqa: BLE001 - DCP's own error, as one line
        raise CheckpointError(f"checkpoint {path}: DCP's metadata is unreadable ({type(exc).__name__}: {exc})") from None
    items = {key: meta for key, meta in metadata.state_dict_metadata.items() if key.startswith(prefix)}
    others = [key for key, meta in items.items() if not isinstance(meta, TensorStorageMetadata)]
    if others:
        raise CheckpointError(f"checkpoint {path}: {name} holds entries that are not tensors ({others[0]}); "
                              "export takes tensors only")
    state = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in items.items()}
    if not state:
        raise CheckpointError(f"checkpoint {path} holds no tensors of {name!r}")
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": as meant
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {key[len(prefix):]: tensor for key, tensor in state.items()}


def read_step(path: Path) -> int | None:
    from hpc_ddp.common.rundir import CHECKPOINT_NAME

    match = CHECKPOINT_NAME.fullmatch(path.name)
    return int(match.group(1)) if match else None


def model_state(loaded: Any) -> dict[str, torch.Tensor]:
    """The model of a loaded (verified) checkpoint: its model.pt, or a sharded one's model put together."""
    if "model.pt" in loaded.payloads:
        return loaded.payloads["model.pt"]
    if "model" in sharded_states(loaded.manifest):
        return consolidated_state(loaded.path, "model", verified=True)
    raise CheckpointError(f"checkpoint {loaded.path} holds no model (no model.pt, no sharded 'model')")
