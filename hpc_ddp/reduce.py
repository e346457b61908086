"""A DDP communication hook that sums gradients in rank order, element by element.

Why: gloo's ring all-reduce adds the ranks' values in an order that depends on where an element sits
in its bucket. DDP lays its buckets out one way for the first iteration after it is built and another
way once it has seen the gradients' order, so after a resume the first step's gradients can differ in
the last bit from the uninterrupted run's (world size > 2; with two ranks addition commutes). Summing
the gathered buckets in rank order, g0 + g1 + g2 + ..., makes every step independent of the layout,
hence bitwise-exact resume on CPU. Used with gloo and more than two ranks only: it moves world_size x
the bucket, which costs more than a ring all-reduce, and two ranks need no help.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime and
# needs `bucket: dist.GradBucket` as the real class, not a string.
import torch
import torch.distributed as dist

__all__ = ["ordered_allreduce_hook"]


def ordered_allreduce_hook(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    world = dist.get_world_size()
    parts = [torch.empty_like(buffer) for _ in range(world)]
    future = dist.all_gather(parts, buffer, async_op=True).get_future()

    def mean_in_rank_order(done: torch.futures.Future) -> torch.Tensor:
        gathered = done.value()
        total = gathered[0].clone()
        for part in gathered[1:]:
            total += part
        return total.div_(world)

    return future.then(mean_in_rank_order)
