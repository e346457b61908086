"""Asynchronous checkpoints (hpc_ddp.trainer.asyncsave, Session's periodic saves): the snapshot is exact, async and
blocking saves write the same bytes, one write at a time, a stop and finish() wait for durability, a failed
write surfaces on the next step, resume stays bitwise, and a SIGKILL during the background write leaves a
checkpoint that loads."""

from __future__ import annotations

import errno
import io
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

import hpc_ddp
from hpc_ddp.common.events import read_jsonl
from hpc_ddp.spec.trainconfig import parse_train
from hpc_ddp.trainer import checkpoint as ckpt
from hpc_ddp.trainer.asyncsave import BackgroundWriter, Snapshotter
from hpc_ddp.trainer.checkpoint import CheckpointError, CheckpointManager, verify
from hpc_ddp.trainer.session import Session

REPO = Path(__file__).resolve().parents[2]


def serialized(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# ---- the snapshot ----

def test_a_snapshot_serializes_to_the_same_bytes_and_does_not_follow_the_live_state():
    net = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(4, 6)).sum().backward()
    opt.step()
    model = net.state_dict()
    model["alias"] = model["0.weight"][1:3]  # shares a storage: must stay shared, as torch.save keeps it
    payloads = {"model.pt": model, "optimizer.pt": opt.state_dict(),
                "extra.pt": {"step": 3, "pair": (1, torch.arange(4)), "names": ["a", "b"], "scalar": torch.tensor(2.5),
                             "empty": [torch.empty(0), torch.zeros(0, 3)], "transposed": torch.arange(6.).view(2, 3).t()}}
    before = {name: serialized(obj) for name, obj in payloads.items()}
    snapshot = Snapshotter().take(payloads)
    taken = snapshot.ready()
    assert isinstance(taken["model.pt"], OrderedDict)
    assert {name: serialized(obj) for name, obj in taken.items()} == before
    with torch.no_grad():  # training goes on: the snapshot keeps the values it was taken with
        for p in net.parameters():
            p.add_(1.0)
    opt.step()
    assert {name: serialized(obj) for name, obj in taken.items()} == before
    assert taken["model.pt"]["alias"].untyped_storage().data_ptr() == \
        taken["model.pt"]["0.weight"].untyped_storage().data_ptr()


def test_the_next_snapshot_reuses_the_host_buffers_of_the_previous_one():
    state = {"w": torch.randn(1000), "b": torch.randn(10)}
    snapshots = Snapshotter()
    first = snapshots.take({"m.pt": state})
    pointers = {first.payloads["m.pt"][k].untyped_storage().data_ptr() for k in state}
    snapshots.recycle(first)
    state["w"].add_(1)
    second = snapshots.take({"m.pt": state})
    assert {second.payloads["m.pt"][k].untyped_storage().data_ptr() for k in state} == pointers
    assert torch.equal(second.payloads["m.pt"]["w"], state["w"])


# ---- the writer ----

def test_a_failed_background_write_surfaces_once_as_the_same_error():
    writer = BackgroundWriter()

    def fail():
        raise CheckpointError("saving checkpoint step-000000004 failed: no space; the previous one is kept")
    writer.start(fail)
    writer._thread.join()
    with pytest.raises(CheckpointError, match="no space; the previous one is kept"):
        writer.check()
    writer.check()  # said once


def test_an_unexpected_writer_exception_becomes_one_checkpoint_error_line():
    writer = BackgroundWriter()
    writer.start(lambda: 1 / 0)
    with pytest.raises(CheckpointError, match="background checkpoint write failed: ZeroDivisionError"):
        writer.wait()


# ---- the session ----

from test_session import Data, session  # noqa: E402  the same dataset and single-rank session


def train(run_dir, *, stop_at=None, crash_at=None, epochs=3, before_step=None, **settings):
    """The README's loop at world size 1. `stop_at`: a stop request (SystemExit 75); `crash_at`: an
    exception before that step (no stop checkpoint, as a node failure would leave it)."""
    run = session(run_dir, **settings)
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = run.loader(Data(), batch_size=8)
        run.track(model=model, optimizer=opt)
        run.resume(total_steps=epochs * 8)
        for _epoch in run.epochs(epochs):
            for x, y in loader:
                if run.progress.step + 1 == crash_at:
                    raise RuntimeError("node failure")
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if run.progress.step + 1 == stop_at:
                    run.stop.request("test")
                if before_step is not None:
                    before_step(run)
                run.step(loss)
        run.finish()
        return {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        run.close()


def files_of(run_dir: Path) -> dict[str, dict]:
    """checkpoint name -> its manifest's files (sizes and sha256) and model hash."""
    manager = CheckpointManager(run_dir / "checkpoints", log=pytest.fail)
    return {p.name: (verify(p)["files"], verify(p)["model_sha256"]) for p in manager.checkpoints()}


def test_async_and_blocking_periodic_saves_write_identical_checkpoints(tmp_path):
    train(tmp_path / "async", checkpoint_every_steps=3, keep=10)
    train(tmp_path / "sync", checkpoint_every_steps=3, keep=10, async_checkpoint=False)
    saved = files_of(tmp_path / "async")
    assert len(saved) == 9  # steps 3, 6, ..., 24 and the final save of step 24 again
    assert saved == files_of(tmp_path / "sync")
    records = [e for e in read_jsonl(tmp_path / "async" / "events.jsonl") if e["event"] == "checkpoint"]
    assert [e.get("background", False) for e in records] == [True] * 8 + [False]
    assert all(e["blocked_s"] <= e["seconds"] for e in records[:-1])


def slow_saves(run: Session, monkeypatch, seconds: float = 0.15) -> list[tuple[str, int, float, float]]:
    """Make every checkpoint write take `seconds`; returns (thread name, step, start, end) per write."""
    real, log, active, lock = run.checkpoints.save, [], [0], threading.Lock()

    def save(step, payloads, meta):
        with lock:
            active[0] += 1
            assert active[0] == 1, "two checkpoint writes at once"
        started = time.monotonic()
        time.sleep(seconds)
        try:
            return real(step, payloads, meta)
        finally:
            with lock:
                active[0] -= 1
            log.append((threading.current_thread().name, step, started, time.monotonic()))
    monkeypatch.setattr(run.checkpoints, "save", save)
    return log


def test_at_most_one_write_in_flight_and_a_stop_waits_for_it(tmp_path, monkeypatch):
    run = session(tmp_path, checkpoint_every_steps=1, keep=10)
    writes = slow_saves(run, monkeypatch)
    model = nn.Linear(2, 1)
    run.track(model=model)
    stepped = []
    for _ in range(3):
        started = time.monotonic()
        run.step()
        stepped.append(time.monotonic() - started)
    assert run._writer.busy
    assert stepped[0] < 0.1  # the first periodic save did not wait for its write
    run.stop.request("test")
    with pytest.raises(SystemExit) as stopped:
        run.step()
    exited = time.monotonic()
    run.close()
    assert stopped.value.code == hpc_ddp.REQUEUE_EXIT_CODE
    assert [step for _name, step, _s, _e in writes] == [1, 2, 3, 4]
    assert all(b[2] >= a[3] for a, b in zip(writes, writes[1:]))  # each write began after the last ended
    assert all(name == "hpc-ddp-checkpoint-writer" for name, *_ in writes[:3])
    assert writes[-1][3] <= exited  # exit 75 only once the stop's checkpoint is durable
    events = [e["event"] for e in read_jsonl(tmp_path / "events.jsonl")]
    assert events[-2:] == ["checkpoint", "requeue_requested"] and events.count("checkpoint") == 4
    loaded = CheckpointManager(tmp_path / "checkpoints", log=pytest.fail).load_latest()
    assert loaded.step == 4 and loaded.manifest["reason"] == "stop"


def test_finish_waits_for_the_write_in_flight(tmp_path, monkeypatch):
    run = session(tmp_path, checkpoint_every_steps=2)
    writes = slow_saves(run, monkeypatch, seconds=0.3)
    run.track(model=nn.Linear(2, 1))
    run.step()
    run.step()
    assert run._writer.busy
    path = run.finish()
    assert not run._writer.busy and [w[1] for w in writes] == [2, 2]
    assert path.name == "step-000000002-r1" and verify(path)["reason"] == "final"
    run.close()


def test_close_without_finish_lets_the_write_in_flight_complete(tmp_path, monkeypatch):
    run = session(tmp_path, checkpoint_every_steps=1)
    slow_saves(run, monkeypatch, seconds=0.3)
    run.track(model=nn.Linear(2, 1))
    run.step()
    run.close()  # as `with` does when the loop raised
    assert CheckpointManager(tmp_path / "checkpoints", log=pytest.fail).load_latest().step == 1


def test_a_failed_background_write_stops_the_next_step_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run = session(tmp_path, checkpoint_every_steps=2)
    run.track(model=nn.Linear(2, 1))
    run.step()
    run.step()
    assert run.wait_for_checkpoint().name == "step-000000002"
    real = ckpt._stream_durable

    def full_disk(path, produce):
        if Path(path).name == "model.pt":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, produce)
    monkeypatch.setattr(ckpt, "_stream_durable", full_disk)
    run.step()
    run.step()  # the periodic save of step 4 fails in the background
    run._writer._thread.join()
    with pytest.raises(CheckpointError, match="no space left on device saving checkpoint step-000000004.*"
                                              "the previous checkpoint step-000000002 is kept"):
        run.step()
    run.close()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step-000000002"]


@pytest.mark.parametrize("stop_at", [5, 9, 24])
def test_stop_after_background_saves_resumes_bitwise(tmp_path, stop_at):
    whole = train(tmp_path / "whole", checkpoint_every_steps=2)
    with pytest.raises(SystemExit):
        train(tmp_path / "cut", stop_at=stop_at, checkpoint_every_steps=2)
    resumed = train(tmp_path / "cut", checkpoint_every_steps=2)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_crash_resumes_bitwise_from_the_last_background_checkpoint(tmp_path):
    whole = train(tmp_path / "whole", checkpoint_every_steps=4)
    with pytest.raises(RuntimeError, match="node failure"):
        train(tmp_path / "cut", crash_at=11, checkpoint_every_steps=4)
    assert CheckpointManager(tmp_path / "cut" / "checkpoints", log=pytest.fail).load_latest().step == 8
    resumed = train(tmp_path / "cut", checkpoint_every_steps=4)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_the_trainer_setting_is_parsed():
    assert parse_train({}).async_checkpoint is True
    assert parse_train({"async_checkpoint": False}).async_checkpoint is False
    with pytest.raises(ValueError, match="async_checkpoint"):
        parse_train({"async_checkpoint": "no"})


# ---- SIGKILL during the background write ----

HELPER = textwrap.dedent("""
    import os, sys
    import torch
    from hpc_ddp.trainer.asyncsave import BackgroundWriter, Snapshotter
    from hpc_ddp.trainer.checkpoint import CheckpointManager

    root, record, first = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(first)
    # about 16 MB of float32 weights, so a write takes a while and kills land inside it
    net = torch.nn.Sequential(torch.nn.Linear(2048, 1024), torch.nn.Linear(1024, 2048))
    manager = CheckpointManager(root, keep=3, log=lambda _m: None)
    writer, snapshots, previous = BackgroundWriter(), Snapshotter(), None
    fd = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    done = lambda path, _s: os.write(fd, b"%d\\n" % int(path.name[5:14]))  # one write: whole or absent
    step = first
    print("ready", flush=True)
    while True:
        with torch.no_grad():  # "training": the live weights change while the last snapshot is written
            for p in net.parameters():
                p.fill_(float(step))
        if not writer.busy:
            writer.wait()
            if previous is not None:
                snapshots.recycle(previous)
            previous = snapshots.take({"model.pt": net.state_dict(), "train_state.pt": {"step": step}})
            state, at = previous.payloads, step
            writer.start(lambda state=state, at=at: manager.save(at, state, {"epoch": at}), done)
        step += 1
""")


@pytest.mark.timeout(120)
def test_sigkill_during_the_background_write_leaves_a_checkpoint_that_loads(tmp_path):
    root, record = tmp_path / "ckpt", tmp_path / "durable.txt"
    script = tmp_path / "helper.py"
    script.write_text(HELPER)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rng = random.Random(20261123)
    first, kills_mid_write = 1, 0
    for _ in range(6):
        helper = subprocess.Popen([sys.executable, str(script), str(root), str(record), str(first)],
                                  stdout=subprocess.PIPE, text=True, env=env)
        assert helper.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0.3, 1.2))
        helper.send_signal(signal.SIGKILL)
        assert helper.wait() == -signal.SIGKILL
        helper.stdout.close()
        kills_mid_write += any(p.name.startswith(".tmp-") for p in root.iterdir()) if root.exists() else 0
        durable = [int(x) for x in record.read_text().split()] if record.exists() else []
        for path in CheckpointManager(root).checkpoints()[-3:]:
            verify(path)
        logs: list[str] = []
        loaded = CheckpointManager(root, log=logs.append).load_latest()
        if loaded is None:
            assert not durable, "a durable save was lost"
            continue
        # A kill between a checkpoint's rename into place and the `latest` update leaves the previous
        # `latest` (fine: it names a good checkpoint), or none at all on the first save: then the newest
        # complete checkpoint is used, and said. Any other message means `latest` named a bad checkpoint.
        missing = f"hpc-ddp: {root / 'latest'} is missing; using the newest checkpoint found"
        assert logs == ([missing] if not (root / "latest").exists() else []), \
            "a kill left `latest` naming a bad checkpoint"
        assert loaded.step >= max(durable, default=0), "a durable save was lost"
        # the snapshot is of one step: every weight and the train state agree, though training went on
        assert all(torch.all(t == float(loaded.step)) for t in loaded.payloads["model.pt"].values())
        assert loaded.payloads["train_state.pt"] == {"step": loaded.step} == {"step": loaded.manifest["epoch"]}
        first = loaded.step + 1000  # the next helper's steps are new ones
    assert kills_mid_write >= 1, "no kill landed inside a background write; make the writes longer"
