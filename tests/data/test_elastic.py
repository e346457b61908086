"""Resume at another world size with the sample stream exact (issue 32): the position arithmetic and the
sampler, checked against DistributedSampler and against an uninterrupted run's (epoch, index) multiset."""

from __future__ import annotations

import collections

import pytest
from torch.utils.data import DistributedSampler

from hpc_ddp.data.elastic import epoch_samples, resize
from hpc_ddp.data.loaders import ResumableSampler


@pytest.mark.parametrize("size,world,start,shuffle", [(100, 1, 0, True), (100, 4, 0, True), (103, 4, 7, True),
                                                      (10, 3, 2, False), (1000, 8, 100, True), (7, 8, 0, True)])
def test_an_unchanged_world_size_is_distributed_samplers_share(size, world, start, shuffle):
    for rank in range(world):
        ours = ResumableSampler(size, rank=rank, world_size=world, seed=5, shuffle=shuffle, keys=False)
        ours.set_position(3, start)
        theirs = DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=shuffle, seed=5,
                                    drop_last=True)
        theirs.set_epoch(3)
        assert list(ours) == list(theirs)[start:] and len(ours) == len(list(theirs)[start:])


def _trained(size, seed, epochs, schedule, batch):
    """(epoch, index) pairs trained by a run whose world size and accumulation change at the steps in
    `schedule` ([(from_step, world, accum)], steps counted over the run), as the trainer consumes them:
    each step takes `accum` batches of `batch` on each rank; an epoch has floor(N / G) steps."""
    trained = collections.Counter()
    step, epoch, batch_in_epoch = 0, 0, 0
    world, accum = schedule[0][1], schedule[0][2]
    changes = {s: (w, a) for s, w, a in schedule[1:]}
    while epoch < epochs:
        if step in changes:  # a stop and a resume on another world size: the checkpoint's position carries over
            new_world, new_accum = changes.pop(step)
            moved = resize(saved_world=world, world=new_world, batch_size=batch, grad_accum=accum,
                           batch_in_epoch=batch_in_epoch, policy="keep_global_batch")
            assert moved.grad_accum == new_accum
            world, accum, batch_in_epoch = new_world, moved.grad_accum, moved.batch_in_epoch
        g = batch * world * accum
        if batch_in_epoch * batch * world >= epoch_samples(size, g):
            epoch, batch_in_epoch = epoch + 1, 0
            continue
        for rank in range(world):
            sampler = ResumableSampler(size, rank=rank, world_size=world, seed=seed)
            sampler.set_position(epoch, batch_in_epoch * batch)
            keys = list(sampler)[: accum * batch]
            assert len(keys) == accum * batch
            trained.update(keys)
        batch_in_epoch += accum
        step += 1
    return trained


def test_a_run_resumed_on_half_and_then_double_the_ranks_trains_the_uninterrupted_samples():
    whole = _trained(1000, 7, 3, [(0, 8, 1)], batch=4)
    changed = _trained(1000, 7, 3, [(0, 8, 1), (5, 4, 2), (40, 2, 4), (70, 8, 1)], batch=4)
    assert changed == whole and max(whole.values()) == 1
    assert sum(whole.values()) == 3 * (1000 // 32 * 32)


@pytest.mark.parametrize("saved,world,accum,message", [
    (8, 3, 1, "does not split into whole batches of 4 on 3 ranks"),
    (2, 8, 1, "does not split into whole batches"),
])
def test_a_global_batch_that_does_not_split_is_refused_in_one_line(saved, world, accum, message):
    with pytest.raises(ValueError, match=message):
        resize(saved_world=saved, world=world, batch_size=4, grad_accum=accum, batch_in_epoch=6,
               policy="keep_global_batch")


def test_keeping_the_per_rank_batch_says_what_changes():
    moved = resize(saved_world=8, world=4, batch_size=4, grad_accum=1, batch_in_epoch=6, policy="keep_per_rank_batch")
    assert (moved.batch_in_epoch, moved.grad_accum, moved.global_batch) == (12, 1, 16)
    assert "global batch 32 -> 16" in moved.note
    with pytest.raises(ValueError, match="not a whole batch of 4 on each of 16 ranks"):
        resize(saved_world=8, world=16, batch_size=4, grad_accum=1, batch_in_epoch=3, policy="keep_per_rank_batch")


def test_an_unchanged_size_changes_nothing():
    same = resize(saved_world=4, world=4, batch_size=8, grad_accum=2, batch_in_epoch=10, policy="keep_global_batch")
    assert (same.batch_in_epoch, same.grad_accum, same.note) == (10, 2, "")
