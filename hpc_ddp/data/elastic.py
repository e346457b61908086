"""Where a run is inside an epoch, whatever its world size, and what a resume on another world size must do
to go on with the same global sample stream (issue 32). Pure integers; no torch.

An epoch's global order is one permutation of the dataset (DistributedSampler's: seeded by seed + epoch,
independent of the world size). W ranks consume it interleaved: rank r's j-th sample is order[r + j*W], so
after s optimizer steps of G samples each (G = batch x W x accumulation, the global batch) exactly the
prefix order[:s*G] has been trained, and an epoch trains floor(N / G) * G samples. A resume on W' ranks
that keeps G (accumulation x W / W') continues from the same prefix, rank r' taking order[s*G + r' :: W']:
over the whole run no sample of an epoch is skipped or repeated. Keeping the per-rank batch instead changes
G, the steps per epoch and the samples an epoch's end leaves out: stated, not hidden.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["POLICIES", "Resized", "global_consumed", "rank_share", "epoch_samples", "resize"]

POLICIES = ("keep_global_batch", "keep_per_rank_batch")
Policy = Literal["keep_global_batch", "keep_per_rank_batch"]


def global_consumed(batch_in_epoch: int, batch_size: int, world_size: int) -> int:
    """Samples of the epoch's global order consumed after `batch_in_epoch` loader batches on each rank."""
    return batch_in_epoch * batch_size * world_size


def epoch_samples(size: int, global_batch: int) -> int:
    """The samples an epoch trains: whole global batches of the order (the tail is left out, as
    DistributedSampler's drop_last, the loader's drop_last and whole accumulated steps together leave it)."""
    return size // global_batch * global_batch


def rank_share(order_length: int, consumed: int, rank: int, world_size: int) -> range:
    """The positions in the epoch's order that `rank` takes from `consumed` on: consumed + rank, then every
    world_size-th, within the first floor(N / W) * W (DistributedSampler's drop_last). For an unchanged world
    size this is DistributedSampler's share with its first consumed / W entries skipped."""
    end = order_length // world_size * world_size
    return range(consumed + rank, end, world_size)


@dataclasses.dataclass(frozen=True)
class Resized:
    """How a run saved by `saved_world` ranks goes on with `world` ranks."""
    batch_in_epoch: int      # loader batches per rank already consumed in the resumed epoch, at `world`
    grad_accum: int          # micro-batches per optimizer step from now on
    global_batch: int        # samples per optimizer step from now on
    note: str                # the one line the rank logs (empty when nothing changed)


def resize(*, saved_world: int, world: int, batch_size: int, grad_accum: int, batch_in_epoch: int,
           policy: Policy) -> Resized:
    """The resumed run's position and accumulation. Raises ValueError (the one line to say) when the
    policy cannot hold at this size: the global batch does not split into whole per-rank micro-batches,
    or the position inside the epoch does not fall on a whole batch of every rank."""
    if policy not in POLICIES:
        raise ValueError(f"elastic policy {policy!r} is not one of {', '.join(POLICIES)}")
    if saved_world == world:
        return Resized(batch_in_epoch, grad_accum, batch_size * world * grad_accum, "")
    consumed = global_consumed(batch_in_epoch, batch_size, saved_world)
    old_global = batch_size * saved_world * grad_accum
    if policy == "keep_global_batch":
        per_step = batch_size * world
        if old_global % per_step:
            raise ValueError(f"the global batch of {old_global} ({saved_world} ranks x {grad_accum} x {batch_size}) "
                             f"does not split into whole batches of {batch_size} on {world} ranks")
        accum = old_global // per_step
        note = (f"resumed on {world} ranks (saved by {saved_world}): global batch kept at {old_global} with "
                f"gradient accumulation {grad_accum} -> {accum}")
    else:
        accum = grad_accum
        note = (f"resumed on {world} ranks (saved by {saved_world}): per-rank batch kept, global batch "
                f"{old_global} -> {batch_size * world * accum} (steps per epoch and the learning-rate schedule's "
                "length change with it)")
    if consumed % (batch_size * world):
        raise ValueError(f"the run stopped {consumed} samples into its epoch, which is not a whole batch of "
                         f"{batch_size} on each of {world} ranks")
    return Resized(consumed // (batch_size * world), accum, batch_size * world * accum, note)
