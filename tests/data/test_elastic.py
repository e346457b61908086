"""Resume at another world size with the sample stream exact (issue 32): the position arithmetic and the
sampler, checked against DistributedSampler and against an uninterrupted run's (epoch, index) multiset."""

from __future__ import annotations

import collections

import pytest
from torch.utils.data import DistributedSampler

from hpc_ddp.data.elastic import Split, epoch_samples, rank_share, resize, split_share
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


def _trained_uneven(size, seed, epochs, batch, global_batch, worlds):
    """(epoch, index) pairs trained by a run of global batch `global_batch`, per-rank batch at most `batch`,
    stopped and resumed at the steps `worlds` names ({step: world}, 0 the first), as the Session does it:
    rank 0 saves batch_in_epoch and the accumulation; each rank of the next size gets its plan from resize()
    and positions its sampler with place(). Also returns each step's per-rank sample counts and weights."""
    trained, counts = collections.Counter(), []
    step, epoch, saved_batches, saved_accum, world = 0, 0, 0, None, None
    worlds = dict(worlds)
    while epoch < epochs:
        if step in worlds:
            new_world = worlds.pop(step)
            plans = [resize(saved_world=world or new_world, world=new_world, batch_size=batch,
                            grad_accum=saved_accum or global_batch // (batch * new_world), batch_in_epoch=saved_batches,
                            policy="keep_global_batch", global_batch=global_batch, rank=r) for r in range(new_world)]
            world, split = new_world, plans[0].split
            samplers = [ResumableSampler(size, rank=r, world_size=world, seed=seed) for r in range(world)]
            for r, sampler in enumerate(samplers):
                sampler.place(epoch, plans[r].consumed, split)
            accum, batches = plans[0].grad_accum, plans[0].batch_in_epoch
            assert {(p.grad_accum, p.batch_in_epoch) for p in plans} == {(accum, batches)}
            streams = [iter(s) for s in samplers]
        if batches // accum >= size // global_batch:  # the epoch's whole steps are done
            epoch, batches = epoch + 1, 0
            for sampler in samplers:
                sampler.set_epoch(epoch)
            streams = [iter(s) for s in samplers]
            continue
        per_rank = []
        for r in range(world):
            keys = [next(streams[r]) for _ in range(accum * split.rank_batch(r))]
            trained.update(keys)
            per_rank.append((len(keys), split.loss_weight(r), accum))
        counts.append(per_rank)
        batches += accum
        saved_batches, saved_accum = batches, accum
        step += 1
    return trained, counts


def test_a_run_resized_4_3_2_4_with_uneven_splits_trains_the_uninterrupted_samples():
    """Issue 44: a global batch of 32 (4 ranks x 8) resumed on 3 (2 micro-steps of 16: 6, 5, 5 a rank),
    then on 2, 4, 3 and 5, trains exactly the uninterrupted multiset, 32 samples every step, and the
    weights make every sample count 1/32 of the gradient."""
    whole, _ = _trained_uneven(1000, 7, 3, 8, 32, {0: 4})
    changed, counts = _trained_uneven(1000, 7, 3, 8, 32, {0: 4, 5: 3, 40: 2, 70: 4, 80: 3, 85: 5})
    assert changed == whole and max(whole.values()) == 1 and sum(whole.values()) == 3 * (1000 // 32 * 32)
    for step in counts:
        assert sum(n for n, _, _ in step) == 32
        # a sample's share of the gradient: its micro-batch mean (1 / b_r) x w_r, then DDP's mean over W ranks
        assert all(w / (n / a) / len(step) == pytest.approx(1 / 32) for n, w, a in step)
    assert [(12, 6 * 3 / 32, 2), (10, 5 * 3 / 32, 2), (10, 5 * 3 / 32, 2)] in counts


def test_uneven_split_and_loss_weight():
    split = Split(32, 8, 3)
    assert (split.accum, split.micro, [split.rank_batch(r) for r in range(3)], split.even) == (2, 16, [6, 5, 5], False)
    # the gradient: sum over ranks of (weight x sum of its micro-batch means) / W = the mean over all G samples
    value = {p: float(p * p) for p in range(64, 96)}
    total = sum(split.loss_weight(r) * sum(sum(value[p] for p in split.positions(64, r)[m * split.rank_batch(r):
                                                                                        (m + 1) * split.rank_batch(r)])
                                           / split.rank_batch(r) for m in range(split.accum)) for r in range(3)) / 3
    assert total == pytest.approx(sum(value.values()) / 32)
    assert sorted(p for r in range(3) for p in split.positions(64, r)) == list(range(64, 96))
    assert Split(32, 8, 4).even and Split(32, 8, 4).loss_weight(0) == 1.0 and Split(32, 4, 4).loss_weight(3) == 0.5
    assert (Split(16, 8, 4).accum, Split(16, 8, 4).rank_batch(3)) == (1, 4)  # 2 -> 4 ranks: smaller batches
    assert Split(7, 1, 3).accum == 1  # nothing fits a batch of 1: the smallest there is (3, 2, 2)


@pytest.mark.parametrize("saved,world,accum", [(4, 4, 1), (4, 2, 2), (2, 4, 2), (8, 8, 3)])
def test_an_even_split_deals_the_positions_as_the_interleaved_share(saved, world, accum):
    """Micro-steps of b x W interleaved are DistributedSampler's interleaving: an unchanged size is unchanged."""
    split = Split(4 * saved * accum, 4, world)
    assert split.even
    for rank in range(world):
        assert split_share(500, 0, rank, split) == \
            list(rank_share(500, 0, rank, world))[: 500 // split.global_batch * split.accum * 4]


def test_uneven_on_the_same_size_resumes_where_it_stopped():
    moved = [resize(saved_world=3, world=3, batch_size=8, grad_accum=2, batch_in_epoch=10, policy="keep_global_batch",
                    global_batch=32, rank=r) for r in range(3)]
    assert {(m.batch_in_epoch, m.grad_accum, m.consumed) for m in moved} == {(10, 2, 160)}


def test_a_global_batch_smaller_than_the_ranks_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"the global batch of 8 cannot be shared by 16 ranks \(fewer than one "
                                         r"sample each\) \(2 ranks x 1 x 4\)"):
        resize(saved_world=2, world=16, batch_size=4, grad_accum=1, batch_in_epoch=6, policy="keep_global_batch")


def test_32_on_3_ranks_goes_on_and_says_how():
    moved = resize(saved_world=4, world=3, batch_size=8, grad_accum=1, batch_in_epoch=6, policy="keep_global_batch",
                   rank=2)
    assert (moved.grad_accum, moved.global_batch, moved.consumed, moved.batch_in_epoch) == (2, 32, 192, 12)
    assert "global batch kept at 32 as 2 micro-steps of 16, per-rank batches 6 or 5 (was 8)" in moved.note
    grown = resize(saved_world=2, world=4, batch_size=8, grad_accum=1, batch_in_epoch=3, policy="keep_global_batch")
    assert (grown.grad_accum, grown.split.rank_batch(0), grown.batch_in_epoch) == (1, 4, 3)


def test_keeping_the_per_rank_batch_says_what_changes():
    moved = resize(saved_world=8, world=4, batch_size=4, grad_accum=1, batch_in_epoch=6, policy="keep_per_rank_batch")
    assert (moved.batch_in_epoch, moved.grad_accum, moved.global_batch) == (12, 1, 16)
    assert "global batch 32 -> 16" in moved.note
    with pytest.raises(ValueError, match="not a whole batch of 4 on each of 16 ranks"):
        resize(saved_world=8, world=16, batch_size=4, grad_accum=1, batch_in_epoch=3, policy="keep_per_rank_batch")


def test_an_unchanged_size_changes_nothing():
    same = resize(saved_world=4, world=4, batch_size=8, grad_accum=2, batch_in_epoch=10, policy="keep_global_batch")
    assert (same.batch_in_epoch, same.grad_accum, same.note) == (10, 2, "")


@pytest.mark.parametrize("world", [1, 2, 3, 5, 7])
def test_the_weighted_rank_gradients_averaged_are_the_global_batchs_gradient(world):
    """With autograd: each rank's micro-batches (Split.positions), each mean loss x loss_weight(rank), summed
    per rank, then DDP's mean over ranks, is the gradient of the global batch's mean loss."""
    import torch

    torch.manual_seed(0)
    x, y = torch.randn(64, 3, dtype=torch.float64), torch.randn(64, 1, dtype=torch.float64)
    w = torch.randn(3, 1, dtype=torch.float64, requires_grad=True)
    ((x[32:64] @ w - y[32:64]) ** 2).mean().backward()
    expected, w.grad = w.grad.clone(), None
    split = Split(32, 8, world)
    per_rank = []
    for rank in range(world):
        positions = split.positions(32, rank)
        size = split.rank_batch(rank)
        for m in range(split.accum):
            idx = positions[m * size:(m + 1) * size]
            (((x[idx] @ w - y[idx]) ** 2).mean() * split.loss_weight(rank)).backward()
        per_rank.append(w.grad.clone())
        w.grad = None
    assert torch.allclose(sum(per_rank) / world, expected, rtol=1e-12, atol=1e-12)


def test_where_no_split_keeps_every_rank_within_its_batch_the_smallest_ones_are_taken_as_the_docs_say():
    """Issue 53's doc mismatch: 4 ranks x 1 resumed on 3 cannot keep every rank at 1 (4 has no divisor that
    gives 3 ranks one each), so batches of 2 or 1, said in the log line docs/preemption.md quotes."""
    from pathlib import Path

    done = resize(saved_world=4, world=3, batch_size=1, grad_accum=1, batch_in_epoch=0, policy="keep_global_batch")
    assert "per-rank batches 2 or 1 (was 1)" in done.note
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "preemption.md").read_text().split())
    assert "`per-rank batches 2 or 1 (was 1)`" in doc
