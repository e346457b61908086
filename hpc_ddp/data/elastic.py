"""Where a run is inside an epoch, whatever its world size, and what a resume on another world size must do
to go on with the same global sample stream (issue 32). Pure integers; no torch.

An epoch's global order is one permutation of the dataset (DistributedSampler's: seeded by seed + epoch,
independent of the world size). W ranks consume it interleaved: rank r's j-th sample is order[r + j*W], so
after s optimizer steps of G samples each (G = batch x W x accumulation, the global batch) exactly the
prefix order[:s*G] has been trained, and an epoch trains floor(N / G) * G samples. A resume on W' ranks
that keeps G (accumulation x W / W') continues from the same prefix, rank r' taking order[s*G + r' :: W']:
over the whole run no sample of an epoch is skipped or repeated. Keeping the per-rank batch instead changes
G, the steps per epoch and the samples an epoch's end leaves out: stated, not hidden.

A global batch the new size does not divide (issue 44: 32 on 3 ranks) is kept with uneven per-rank
batches (`Split`): every rank takes the same number a of micro-batches per step (so every rank runs the
same collectives, whether or not its loop uses no_sync), a micro-step's M = G / a samples are shared as
evenly as the ranks allow (M // W each, one more for the first M % W ranks), a is the smallest divisor of
G that keeps every rank's micro-batch at most the batch the run was planned with (its memory), and each
micro-batch's mean loss is weighted by b_r x W / G, so that DDP's average over ranks is the global batch's
mean gradient (1 / a when every rank takes b: the only case before). A micro-step's positions are
interleaved as above (r, r + W, ...), so a split with every rank at b is DistributedSampler's own. A
global batch smaller than the ranks (a rank with nothing) is refused in one line.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["POLICIES", "Resized", "Split", "global_consumed", "rank_share", "split_share", "epoch_samples",
           "resize"]

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
class Split:
    """How W ranks share one optimizer step's global batch of G samples, each rank's micro-batch at most
    `batch_size` (the per-rank batch the run was planned with)."""
    global_batch: int
    batch_size: int
    world: int

    def __post_init__(self) -> None:
        if min(self.global_batch, self.batch_size, self.world) < 1:
            raise ValueError(f"a global batch of {self.global_batch} on {self.world} ranks in batches of "
                             f"{self.batch_size} is not a split")
        if self.global_batch < self.world:
            raise ValueError(f"the global batch of {self.global_batch} cannot be shared by {self.world} ranks "
                             f"(fewer than one sample each)")

    @property
    def accum(self) -> int:
        """a: micro-batches per optimizer step, the same on every rank: the smallest divisor of G whose
        micro-step of G / a samples gives no rank more than `batch_size` and every rank at least one."""
        g, w = self.global_batch, self.world
        fits = [a for a in range(1, g // w + 1) if g % a == 0]   # a = 1 always: G >= W
        within = [a for a in fits if -(-(g // a) // w) <= self.batch_size]
        # None within (a batch of 1 on 7 ranks, resumed on 3): the smallest per-rank batch there is.
        return within[0] if within else min(fits, key=lambda a: (-(-(g // a) // w), a))

    @property
    def micro(self) -> int:
        """M: the samples of one micro-step, all ranks together."""
        return self.global_batch // self.accum

    def rank_batch(self, rank: int) -> int:
        """b_r: `rank`'s micro-batch."""
        return self.micro // self.world + (rank < self.micro % self.world)

    @property
    def even(self) -> bool:
        """Every rank takes `batch_size` (the classic split: batch x ranks x accumulation = G)."""
        return self.micro == self.batch_size * self.world

    def loss_weight(self, rank: int) -> float:
        """What `rank`'s micro-batch mean loss is multiplied by: b_r x W / G (1 / a for an even split)."""
        return 1 / self.accum if self.even else self.rank_batch(rank) * self.world / self.global_batch

    def positions(self, start: int, rank: int) -> list[int]:
        """The positions of the epoch's order `rank` trains in the step that starts at `start`, micro-batch
        after micro-batch: in each micro-step of M, rank r takes r, r + W, ... (b_r of them)."""
        out: list[int] = []
        for m in range(self.accum):
            first = start + m * self.micro + rank
            out += range(first, first + self.rank_batch(rank) * self.world, self.world)
        return out


def split_share(order_length: int, consumed: int, rank: int, split: Split) -> list[int]:
    """The positions `rank` trains from `consumed` to its epoch's end, step by step under `split`: whole
    steps only (an epoch trains floor(N / G) of them), so every rank's share ends at the same step."""
    out: list[int] = []
    start = consumed
    while start + split.global_batch <= order_length:
        out += split.positions(start, rank)
        start += split.global_batch
    return out


@dataclasses.dataclass(frozen=True)
class Resized:
    """How a run saved by `saved_world` ranks goes on with `world` ranks."""
    batch_in_epoch: int      # loader batches per rank already consumed in the resumed epoch, at `world`
    grad_accum: int          # micro-batches per optimizer step from now on
    global_batch: int        # samples per optimizer step from now on
    note: str                # the one line the rank logs (empty when nothing changed)
    split: Split | None = None  # how the ranks share each step from now on
    consumed: int = 0        # samples of the epoch's order already trained (every rank's together)


def resize(*, saved_world: int, world: int, batch_size: int, grad_accum: int, batch_in_epoch: int,
           policy: Policy, global_batch: int | None = None, rank: int = 0) -> Resized:
    """The resumed run's position and accumulation. `grad_accum` and `batch_in_epoch` are the saved run's
    (the same on every rank); `global_batch` the saved run's G where its checkpoint says (a run that was
    itself split unevenly: G is not batch x ranks x accumulation). Raises ValueError (the one line to say)
    when the policy cannot hold at this size: a global batch smaller than the ranks, or a position inside
    the epoch that is not a whole step."""
    if policy not in POLICIES:
        raise ValueError(f"elastic policy {policy!r} is not one of {', '.join(POLICIES)}")
    old_global = global_batch or batch_size * saved_world * grad_accum
    saved = Split(old_global, batch_size, saved_world)
    consumed = global_consumed(batch_in_epoch, batch_size, saved_world) if saved.even else \
        batch_in_epoch // saved.accum * old_global
    if saved_world == world and saved.even:
        return Resized(batch_in_epoch, grad_accum, old_global, "", saved, consumed)
    if policy == "keep_global_batch":
        try:
            split = Split(old_global, batch_size, world)
        except ValueError as exc:
            raise ValueError(f"{exc} ({saved_world} ranks x {grad_accum} x {batch_size})") from None
        if saved_world == world:
            note = ""
        elif split.even:
            note = (f"resumed on {world} ranks (saved by {saved_world}): global batch kept at {old_global} with "
                    f"gradient accumulation {grad_accum} -> {split.accum}")
        else:
            sizes = sorted({split.rank_batch(r) for r in range(world)}, reverse=True)
            note = (f"resumed on {world} ranks (saved by {saved_world}): global batch kept at {old_global} as "
                    f"{split.accum} micro-step{'s' if split.accum > 1 else ''} of {split.micro}, per-rank batches "
                    f"{' or '.join(map(str, sizes))} (was {batch_size}); each rank's loss weighted by its share "
                    "(run.loss_weight())")
    else:
        split = Split(batch_size * world * grad_accum, batch_size, world)
        note = (f"resumed on {world} ranks (saved by {saved_world}): per-rank batch kept, global batch "
                f"{old_global} -> {split.global_batch} (steps per epoch and the learning-rate schedule's "
                "length change with it)")
    if split.even:
        if consumed % (batch_size * world):
            raise ValueError(f"the run stopped {consumed} samples into its epoch, which is not a whole batch of "
                             f"{batch_size} on each of {world} ranks")
        return Resized(consumed // (batch_size * world), split.accum, split.global_batch, note, split, consumed)
    if consumed % split.global_batch:
        raise ValueError(f"the run stopped {consumed} samples into its epoch, which is not a whole number of "
                         f"global batches of {split.global_batch}")
    return Resized(consumed // split.global_batch * split.accum, split.accum, split.global_batch, note, split,
                   consumed)
