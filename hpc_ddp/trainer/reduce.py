"""DDP communication hooks: gradients summed in rank order, and the step's flags carried on the last bucket.

Rank order -- 
Why: gloo's ring all-reduce adds the ranks' values in an order that depends on where an element sits
in its bucket. DDP lays its buckets out one way for the first iteration after it is built and another
way once it has seen the gradients' order, so after a resume the first step's gradients can differ in
the last bit from the uninterrupted run's (world size > 2; with two ranks addition commutes). Summing
the gathered buckets in rank order, g0 + g1 + g2 + ..., makes every step independent of the layout,
hence bitwise-exact resume on CPU. Used with gloo and more than two ranks only: it moves world_size x
the bucket, which costs more than a ring all-reduce, and two ranks need no help.

Flags -- every step the ranks must agree on the mean loss, whether anyone was asked to stop, and
whether a checkpoint is due. A separate all-reduce for three numbers is a second synchronisation point
per step (7-8% of a small CPU step, measured by bench/profile_trainer.py); appended to the last
gradient bucket they travel with the gradients for free. `StepFlags` is the hook's state: the trainer
sets `outgoing` before the synchronising backward and reads `incoming` after it. The flags are summed
in the bucket's dtype (float32): the logged mean loss has float32 precision. Used on CPU (gloo) only so
far; on GPUs the trainer keeps DDP's built-in all-reduce and a separate one for the flags.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime and
# needs `bucket: dist.GradBucket` as the real class, not a string.
import torch
import torch.distributed as dist

__all__ = ["StepFlags", "flags_hook"]


class StepFlags:
    """What rides on the last bucket: `outgoing` (this rank's values) in, `incoming` (their sums) out."""

    def __init__(self, ordered: bool):
        self.ordered = ordered           # sum gradients in rank order (see above)
        self.outgoing: torch.Tensor | None = None
        self.incoming: torch.Tensor | None = None


def _summed(tensor: torch.Tensor, ordered: bool) -> torch.futures.Future:
    if not ordered:
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda done: done.value()[0])
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]

    def in_rank_order(done: torch.futures.Future) -> torch.Tensor:
        gathered = done.value()
        total = gathered[0].clone()
        for part in gathered[1:]:
            total += part
        return total

    return dist.all_gather(parts, tensor, async_op=True).get_future().then(in_rank_order)


def flags_hook(state: StepFlags, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Mean gradients (summed in rank order when `state.ordered`); the flags summed, on the last bucket."""
    buffer, world = bucket.buffer(), dist.get_world_size()
    carry = bucket.is_last() and state.outgoing is not None and buffer.dtype in (torch.float32, torch.float64)
    size = buffer.numel()
    joined = torch.cat([buffer, state.outgoing.to(buffer.dtype)]) if carry else buffer
    if carry:
        state.outgoing = None

    def split(done: torch.futures.Future) -> torch.Tensor:
        total = done.value()
        if carry:
            state.incoming = total[size:].to(torch.float64)
            total = total[:size]
        return total.div_(world)

    return _summed(joined, state.ordered).then(split)
