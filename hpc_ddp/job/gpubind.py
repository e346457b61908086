"""Which GPUs a rank sees, and which of them torch starts on: CUDA_VISIBLE_DEVICES and the default device.

Scripts pick their GPU in different ways (`set_device(LOCAL_RANK)`, `cuda:LOCAL_RANK`, plain `"cuda"`,
Lightning's SLURM_LOCALID, a model spread over `cuda:0` and `cuda:1`), and Slurm exposes GPUs in two ways:
all of a node's GPUs to every task (the default), or some bound to each task (`--gpus-per-task`,
`--gpu-bind=single:1`, a site's job_submit). `bind_gpus` gives each rank a CUDA_VISIBLE_DEVICES and a
default device index under which every common pattern lands each rank on its own GPU:

  auto (default)  one GPU per rank: the node's GPUs stay visible, as under torchrun, so `cuda:LOCAL_RANK`
                  exists, and the rank starts on GPU LOCAL_RANK, so plain `"cuda"` is its own GPU too;
                  several GPUs per rank: the rank sees only its own, as `cuda:0`, `cuda:1`, ...
  node            every rank sees the node's GPUs and starts on its first own one
  rank            every rank sees only its own GPU(s), starting on `cuda:0`

Where Slurm already bound the task's GPUs, the rank sees those (mode "slurm"), whatever was asked.

`cuda_devices` is a model of how CUDA maps CUDA_VISIBLE_DEVICES to physical GPUs (tests/job/
test_gpu_oracle.py checks every pattern against it). Pure: no torch, no environment.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from hpc_ddp.common.errors import EnvError

__all__ = ["NO_GPU", "MODES", "DEVICE_VARIABLE", "BINDING_VARIABLE", "Binding", "entries", "effective_mode",
           "bind_gpus", "own_device", "cuda_devices", "physical_gpu"]

NO_GPU = ("", "-1", "NoDevFiles", "none")
MODES = ("auto", "node", "rank")
DEVICE_VARIABLE = "HPC_DDP_CUDA_DEVICE"  # the rank's default device index, read by exitsite and Session
BINDING_VARIABLE = "HPC_DDP_GPU_BINDING"  # Binding.how, for the start-up checks' messages


@dataclasses.dataclass(frozen=True)
class Binding:
    visible: str | None   # the rank's CUDA_VISIBLE_DEVICES; None: none set (CUDA shows every GPU)
    device: int | None    # index into `visible` that torch's current device starts at; None: no GPU
    how: str              # "node" | "rank" | "slurm" (Slurm bound the task's GPUs) | "none"
    per_rank: int = 0     # GPUs that are this rank's own


def entries(visible: str | None) -> list[str]:
    """CUDA_VISIBLE_DEVICES's entries as written (indices, GPU-/MIG- UUIDs); [] when it hides every GPU."""
    if visible is None or visible.strip() in NO_GPU:
        return []
    return [x.strip() for x in visible.split(",") if x.strip()]


def effective_mode(mode: str, per_task: int) -> str:
    """auto: node-wide visibility for one GPU per rank (every way of picking it works), per-rank
    visibility for several (a model spread over cuda:0..k-1 stays inside the rank's own GPUs)."""
    if mode == "auto":
        return "node" if per_task <= 1 else "rank"
    return mode


def bind_gpus(visible: str | None, local_rank: int, local_world_size: int, per_task: int, mode: str) -> Binding:
    """This rank's binding, from the CUDA_VISIBLE_DEVICES Slurm gave its task."""
    ids = entries(visible)
    if not ids:
        return Binding(visible, None, "none")
    per_task = max(per_task, 1)
    if len(ids) >= local_world_size * per_task:  # Slurm exposed the node's GPUs to every task
        first = local_rank * per_task
        if effective_mode(mode, per_task) == "node":
            return Binding(visible, first, "node", per_task)
        return Binding(",".join(ids[first:first + per_task]), 0, "rank", per_task)
    if len(ids) == per_task:  # Slurm bound this task's GPUs already
        return Binding(",".join(ids), 0, "slurm", per_task)
    raise EnvError(
        f"CUDA_VISIBLE_DEVICES={visible!r} lists {len(ids)} GPU(s), too few for {local_world_size} "
        f"task(s) x {per_task} GPU(s) on this node",
        hint="request as many GPUs per node as tasks per node (hpc-ddp submit --gpus N)",
    )


def own_device(environ: Mapping[str, str], device_count: int) -> int:
    """The index of this rank's own GPU among those it sees: the runner's choice, where it made one that
    exists (a script may have narrowed CUDA_VISIBLE_DEVICES itself), else 0."""
    try:
        index = int(environ.get(DEVICE_VARIABLE, "0"))
    except ValueError:
        return 0
    return index if 0 <= index < device_count else 0


# ---- a model of CUDA ----

def cuda_devices(visible: str | None, physical: Sequence[str]) -> list[str]:
    """The physical GPUs CUDA shows as cuda:0, cuda:1, ... under CUDA_VISIBLE_DEVICES=`visible`.

    `physical`: the node's GPUs as their UUIDs, in the driver's order. As CUDA does: unset shows all;
    an entry is an index or a (prefix of a) GPU-/MIG- UUID; enumeration stops at the first entry that
    names no GPU, is ambiguous, or names one already listed ("0,7" on a 2-GPU node shows only GPU 0;
    "-1" shows none)."""
    if visible is None:
        return list(physical)
    shown: list[str] = []
    for entry in (x.strip() for x in visible.split(",")):
        gpu = _one(entry, physical)
        if gpu is None or gpu in shown:
            break
        shown.append(gpu)
    return shown


def _one(entry: str, physical: Sequence[str]) -> str | None:
    if entry.isdigit():
        index = int(entry)
        return physical[index] if index < len(physical) else None
    if entry.startswith(("GPU-", "MIG-")):
        hits = [uuid for uuid in physical if uuid.startswith(entry)]
        return hits[0] if len(hits) == 1 else None
    return None


def physical_gpu(visible: str | None, index: int, physical: Sequence[str]) -> str | None:
    """The physical GPU `cuda:index` is under `visible`; None: "invalid device ordinal"."""
    shown = cuda_devices(visible, physical)
    return shown[index] if 0 <= index < len(shown) else None
