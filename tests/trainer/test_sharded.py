"""trainer.sharded in one process (a world of one, gloo): which tracked states are sharded, the mistakes it
refuses in one line, and that a sharded save and resume round-trips through DCP's files and the manifest.
The multi-rank paths (shards of every rank, a missing or corrupt shard, another world size) are in
tests/e2e/test_sharded.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from hpc_ddp.common.errors import report
from hpc_ddp.trainer.checkpoint import CheckpointManager
from hpc_ddp.trainer.checkpointread import read_manifest, verify
from hpc_ddp.trainer.consolidate import consolidated_state
from hpc_ddp.trainer.sessionbase import UsageError
from hpc_ddp.trainer.sharded import Sharded, is_sharded_module, load_sharded, refuse_unsupported, save_sharded


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def _train(model, opt, steps=3):
    for i in range(steps):
        torch.manual_seed(100 + i)
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_fully_shard_model_and_its_optimizer_are_the_sharded_states():
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters())
    sharded = Sharded({"model": model, "optimizer": opt, "extra": {"k": 1}, "plain": torch.nn.Linear(1, 1)})
    assert sharded and sharded.names == ["model", "optimizer"]
    assert is_sharded_module(model) and not is_sharded_module(torch.nn.Linear(1, 1))
    assert not Sharded({"model": torch.nn.Linear(1, 1), "optimizer": torch.optim.SGD(torch.nn.Linear(1, 1)
                                                                                      .parameters(), lr=1)})


def test_the_mistakes_are_one_line_each_with_the_fix_as_the_docs_show_them(capsys):
    """docs/session-api.md's lines are what report() prints for each (the sharded-on-some-ranks one needs
    two ranks: its message is built here from the same function's parts)."""
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters())
    docs = (Path(__file__).resolve().parents[2] / "docs" / "session-api.md").read_text()
    fsdp1 = FullyShardedDataParallel(torch.nn.Linear(2, 2), device_id=torch.device("cpu"))
    zero = ZeroRedundancyOptimizer(torch.nn.Linear(2, 2).parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
    for mistake in (lambda: Sharded({"model": model}), lambda: refuse_unsupported("model", fsdp1),
                    lambda: refuse_unsupported("optimizer", zero)):
        with pytest.raises(UsageError) as e:
            mistake()
        assert report(e.value) == 2
        line = capsys.readouterr().err.strip()
        assert line in docs, line
    with pytest.raises(UsageError, match="its model is not tracked") as e:
        Sharded({"optimizer": opt})
    assert "run.track(model=model, optimizer=optimizer)" in e.value.hint


def test_a_sharded_save_resumes_exactly_and_its_manifest_lists_every_file(tmp_path):
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt)
    manager = CheckpointManager(tmp_path / "checkpoints", log=lambda _m: None)
    path = save_sharded(manager, Sharded({"model": model, "optimizer": opt}), 3, {"session.pt": {"x": 1}},
                        {"epoch": 0}, rank=0, world_size=1)
    manifest = verify(path)
    assert manifest["sharded"] == {"world_size": 1, "states": ["model", "optimizer"]}
    assert set(manifest["files"]) == {p.name for p in path.iterdir()} - {"manifest.json"}
    assert ".metadata" in manifest["files"] and "__0_0.distcp" in manifest["files"]

    fresh = _sharded(seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    loaded = load_sharded(manager, Sharded({"model": fresh, "optimizer": fresh_opt}), ("session.pt",), None,
                          rank=0, world_size=1, log=lambda _m: None)
    assert loaded.path == path and loaded.payloads["session.pt"] == {"x": 1}
    _train(model, opt)
    _train(fresh, fresh_opt)  # the optimizer state came back too: the next steps agree bitwise
    for (k, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), k
    full = consolidated_state(path)
    assert list(full) == ["0.weight", "0.bias", "2.weight", "2.bias"] and full["0.weight"].shape == (8, 4)


def test_a_damaged_shard_is_never_loaded_and_the_previous_checkpoint_is(tmp_path):
    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    manager = CheckpointManager(tmp_path / "checkpoints", log=lambda _m: None)
    states = Sharded({"model": model, "optimizer": opt})
    first = save_sharded(manager, states, 1, {"session.pt": {"step": 1}}, {}, rank=0, world_size=1)
    _train(model, opt)
    second = save_sharded(manager, states, 4, {"session.pt": {"step": 4}}, {}, rank=0, world_size=1)
    shard = second / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    said: list[str] = []
    loaded = load_sharded(manager, states, ("session.pt",), None, rank=0, world_size=1, log=said.append)
    assert loaded.path == first and loaded.payloads["session.pt"] == {"step": 1}
    assert said == [f"hpc-ddp: checkpoint file {shard} is damaged: sha256 does not match the manifest; trying the "
                    "previous checkpoint"]
    shard.unlink()  # a rank's file missing: the same
    said.clear()
    assert load_sharded(manager, states, ("session.pt",), None, rank=0, world_size=1, log=said.append).path == first
    assert "is missing" in said[0] and "trying the previous checkpoint" in said[0]
    assert read_manifest(second)["step"] == 4


def test_a_model_sharded_on_some_ranks_only_is_named(monkeypatch, capsys):
    """What every rank says where rank 1 forgot fully_shard (all_gather_object stands in for two ranks)."""
    from hpc_ddp.trainer import sharded

    monkeypatch.setattr(sharded.dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), [True, False]))
    with pytest.raises(UsageError) as e:
        sharded.agree_on_sharding(True, rank=0, world_size=2)
    report(e.value)
    line = capsys.readouterr().err.strip()
    assert line in (Path(__file__).resolve().parents[2] / "docs" / "session-api.md").read_text(), line
    monkeypatch.setattr(sharded.dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None), [True] * 2))
    sharded.agree_on_sharding(True, rank=0, world_size=2)


def test_a_host_copy_cannot_change_with_training_and_reuses_the_last_ones_buffers():
    from hpc_ddp.trainer.sharded import host_copy

    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 1)
    states = Sharded({"model": model, "optimizer": opt})
    first = host_copy(states.state())
    before = {k: v.full_tensor().clone() for k, v in first["model"].items()}
    _train(model, opt, 1)
    assert all(torch.equal(first["model"][k].full_tensor(), before[k]) for k in before)  # not a view of the live
    second = host_copy(states.state(), first)
    assert second["model"]["0.weight"].to_local().data_ptr() == first["model"]["0.weight"].to_local().data_ptr()
    live = states.state()
    assert torch.equal(second["model"]["0.weight"].full_tensor(), live["model"]["0.weight"].full_tensor())
    assert not torch.equal(second["model"]["0.weight"].full_tensor(), before["0.weight"])
    moments = second["optimizer"]["state"]["0.weight"]["exp_avg"]
    assert torch.equal(moments.full_tensor(), live["optimizer"]["state"]["0.weight"]["exp_avg"].full_tensor())
