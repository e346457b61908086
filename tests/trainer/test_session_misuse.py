"""Issue 43's Session API rows, in one process: each misuse is one error that names the fix, before anything
trains in silence (counts of 0 or less, step() after finish(), track() after resume(), another batch size
or another model on resume); and issue 42's samples/s derived from the sampler."""

import json

import pytest
import torch
from torch import nn

from hpc_ddp.job.distenv import from_environ
from hpc_ddp.trainer.session import IncompatibleResume, Session, UsageError


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((4,), float(i)), torch.tensor([float(i)])


def session(run_dir, **settings) -> Session:
    return Session(run_dir, env=from_environ({}, pid=1), **settings).setup()


def stopped_run(run_dir, batch_size=4, model=None):
    """A run checkpointed at step 3 (mid-epoch)."""
    run = session(run_dir, exit_on_stop=False)
    try:
        model = model or nn.Linear(4, 1)
        run.track(model=model)
        loader = run.loader(Data(), batch_size=batch_size)
        run.resume()
        for _ in run.epochs(2):
            for x, _y in loader:
                if run.progress.step == 2:
                    run.stop.request("test")
                if run.step(model(x).sum()):
                    return
    finally:
        run.close()


@pytest.mark.parametrize("call,match", [
    (lambda run: run.accumulation(0, batch_size=4), r"accumulation\(\): grad_accum=0 is not a whole number"),
    (lambda run: run.accumulation(-3, batch_size=4), r"grad_accum=-3"),
    (lambda run: run.accumulation(1, batch_size=0), r"batch_size=0"),
    (lambda run: run.sampler(Data(), batch_size=0), r"sampler\(\): batch_size=0"),
    (lambda run: run.loader(Data(), batch_size=-1), r"loader\(\): batch_size=-1"),
    (lambda run: run.step(batches=0), r"step\(\): batches=0"),
    (lambda run: run.step(batches=-2), r"step\(\): batches=-2"),
])
def test_counts_of_zero_or_less_are_refused(tmp_path, call, match):
    run = session(tmp_path)
    try:
        with pytest.raises(UsageError, match=match):
            call(run)
    finally:
        run.close()


def test_step_after_finish_is_an_error(tmp_path):
    run = session(tmp_path)
    try:
        run.step(1.0)
        run.finish()
        with pytest.raises(UsageError, match=r"step\(\) after finish\(\)"):
            run.step(1.0)
    finally:
        run.close()


def test_track_after_resume_is_an_error_on_the_first_attempt_already(tmp_path):
    run = session(tmp_path)
    try:
        run.resume()  # nothing to resume yet: the order is still wrong, and said now, not on the resume
        with pytest.raises(UsageError, match=r"track\(model=\.\.\.\) after resume\(\)"):
            run.track(model=nn.Linear(4, 1))
    finally:
        run.close()


def test_a_changed_batch_size_on_resume_is_refused(tmp_path):
    stopped_run(tmp_path, batch_size=4)
    run = session(tmp_path)
    try:
        run.track(model=nn.Linear(4, 1))
        with pytest.raises(IncompatibleResume, match="cannot resume with batch_size 8: the checkpoint was saved "
                                                     "with batch_size 4") as info:
            run.accumulation(1, batch_size=8)
        assert "batch_size=4" in info.value.hint
    finally:
        run.close()
    run = session(tmp_path)   # without accumulation(): the loader's batch size, at resume()
    try:
        run.track(model=nn.Linear(4, 1))
        run.loader(Data(), batch_size=8)
        with pytest.raises(IncompatibleResume, match="batch_size 8"):
            run.resume()
    finally:
        run.close()


def test_a_checkpoint_of_another_model_is_one_line(tmp_path):
    stopped_run(tmp_path)
    run = session(tmp_path)
    try:
        run.track(model=nn.Linear(4, 3))
        run.loader(Data(), batch_size=4)
        with pytest.raises(IncompatibleResume, match=r"its model does not fit this run's model \(RuntimeError: "
                                                     r"Error\(s\) in loading state_dict for Linear") as info:
            run.resume()
        assert "\n" not in str(info.value) and "same model" in info.value.hint
    finally:
        run.close()


def test_samples_per_second_comes_from_the_sampler(tmp_path):
    run = session(tmp_path, log_every=2)
    try:
        loader = run.loader(Data(), batch_size=4)
        for _ in run.epochs(1):
            for _x in loader:
                run.step(1.0)
        assert run.progress.samples == 64
    finally:
        run.close()
    rates = [json.loads(line).get("samples_per_s") for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rates and all(r > 0 for r in rates)


def test_a_loop_without_a_sampler_resumed_on_another_size_says_what_it_lacks(tmp_path):
    """Issue 43: it was refused with invented numbers ("global batch of 2 ... batches of 1")."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "localhost",
           "MASTER_PORT": "29500"}
    run = Session(tmp_path, env=from_environ(env, pid=1))   # not set up: no rendezvous needed for this
    run.elastic = "keep_global_batch"
    with pytest.raises(IncompatibleResume, match="this loop has no run.sampler.. or run.loader.. and never told "
                                                 "run.accumulation.. its batch size") as info:
        run._resume_resized(2, None, None)
    assert "resume on 2 ranks" in info.value.hint and "global batch of 2" not in str(info.value)


def _world(n: int, rank: int = 0):
    return from_environ({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n),
                         "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}, pid=1)


def test_an_uneven_resume_of_a_sampler_loop_that_never_asks_its_batch_is_refused_naming_what_to_add(tmp_path):
    """A run.sampler() loop builds its own DataLoader: on 3 ranks of a global batch of 32 it must take
    run.batch_size() (6 or 5), or it would train the wrong samples."""
    run = Session(tmp_path, env=_world(3, rank=1))
    run.elastic = "keep_global_batch"
    run.sampler(Data(), batch_size=8)
    run._accum, run._batch_size = 2, 8
    run.progress.batch_in_epoch = 3
    with pytest.raises(IncompatibleResume, match=r"splits unevenly there \(per-rank batches 6 to 5, 2 a step\).*"
                                                 r"never asked for run.batch_size\(\)") as info:
        run._resume_resized(4, 1, None)
    assert "run.loss_weight()" in info.value.hint
    run.batch_size()   # asked: it goes on, at this rank's batch and weight
    run._resume_resized(4, 1, None)
    assert (run.batch_size(), run.loss_weight(), run.progress.batch_in_epoch) == (5, 5 * 3 / 32, 6)


def test_one_rank_is_a_world_of_one_that_ddp_can_wrap(tmp_path):
    """Issue 42 item 0: DDP on one rank died with 'Default process group has not been initialized'."""
    import torch.distributed as dist

    run = session(tmp_path)
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1
        model = torch.nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
        model(torch.randn(2, 4)).sum().backward()
        run.step(1.0)
    finally:
        run.close()
    assert not dist.is_initialized()
