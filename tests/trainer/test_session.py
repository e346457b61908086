"""The public API for users' own loops (hpc_ddp.trainer.session), in one process: the public surface, stop ->
checkpoint -> exit 75 -> exact resume, and misuse that must end in one clear error with nothing lost.
Multi-rank behaviour runs end to end in tests/e2e/test_user_scripts.py."""

import os
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import hpc_ddp
from hpc_ddp.job.distenv import from_environ
from hpc_ddp.trainer.checkpoint import BeyondSchedule
from hpc_ddp.trainer.session import Diverged, IncompatibleResume, Session, UsageError

PUBLIC = {"start", "Session", "Progress", "ResumableSampler", "CheckpointManager", "CheckpointError",
          "capture_rng", "restore_rng", "REQUEUE_EXIT_CODE", "UsageError", "IncompatibleResume", "Diverged"}


def test_the_public_surface_is_listed_and_resolves():
    assert PUBLIC <= set(hpc_ddp.__all__)
    for name in hpc_ddp.__all__:
        assert getattr(hpc_ddp, name) is not None, name
    assert hpc_ddp.REQUEUE_EXIT_CODE == 75
    assert hpc_ddp.start.__doc__ and hpc_ddp.Session.step.__doc__ and hpc_ddp.Session.resume.__doc__


def test_importing_hpc_ddp_does_not_import_torch():
    code = "import sys, hpc_ddp; assert 'torch' not in sys.modules; hpc_ddp.start; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


class Data(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.01 * torch.randn(4), self.y[i]  # draws from the RNG: resume must restore it


def session(run_dir, **settings) -> Session:
    return Session(run_dir, env=from_environ({}, pid=1), **settings).setup()


def train(run_dir, *, stop_at=None, epochs=3, lagged=False, **settings):
    """The README's loop at world size 1; returns the final weights (or raises SystemExit at stop_at).
    lagged: read the step's flags one step late, as a GPU run does (hpc_ddp.trainer.lagged)."""
    run = session(run_dir, **settings)
    run._lag_on_cpu = lagged
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        data = Data()
        loader = run.loader(data, batch_size=8)
        run.track(model=model, optimizer=opt)
        run.resume(total_steps=epochs * 8)
        for _epoch in run.epochs(epochs):
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if run.progress.step + 1 == stop_at:
                    run.stop.request("test")  # as the warning signal would
                run.step(loss)
        run.finish()
        return {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        run.close()


@pytest.mark.parametrize("stop_at", [3, 8, 9, 23])  # mid-epoch, at an epoch's end, just after, the last step
def test_stop_checkpoints_exits_75_and_resumes_bitwise(tmp_path, stop_at):
    whole = train(tmp_path / "whole")
    with pytest.raises(SystemExit) as stopped:
        train(tmp_path / "cut", stop_at=stop_at)
    assert stopped.value.code == hpc_ddp.REQUEUE_EXIT_CODE
    resumed = train(tmp_path / "cut")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    events = [e["event"] for e in hpc_ddp.common.events.read_jsonl(tmp_path / "cut" / "events.jsonl")]
    assert events.count("resume") == 1 and events[-1] == "finish" and "requeue_requested" in events


def test_status_and_inspect_read_a_user_loop_run(tmp_path):
    from hpc_ddp.trainer.checkpoint import inspect_checkpoint
    from hpc_ddp.watch.status import run_status

    train(tmp_path, log_every=1)
    info = inspect_checkpoint(tmp_path)
    assert info["step"] == 24 and info["model_sha256"]
    status = run_status(tmp_path, None, None, commands=None)
    assert status["state"] == "COMPLETED" and status["step"] == 24 and status["total_steps"] == 24


def test_periodic_checkpoints_and_keep(tmp_path):
    train(tmp_path, checkpoint_every_steps=5, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert names == ["step-000000020", "step-000000024"]


def test_state_that_holds_code_is_refused_before_anything_is_written(tmp_path):
    run = session(tmp_path)
    try:
        run.track(model=nn.Linear(2, 1), extra={"schedule": lambda step: 0.5})
        with pytest.raises(UsageError, match=r"extra\['schedule'\] is a builtins.function"):
            run.save()
        assert not list((tmp_path / "checkpoints").glob("*"))
    finally:
        run.close()


@pytest.mark.parametrize("objects,match", [
    ({"model": object()}, "has no state_dict"),
    ({"session": {}}, "cannot name a checkpoint file"),
    ({"a/b": {}}, "cannot name a checkpoint file"),
])
def test_track_refuses_what_it_cannot_checkpoint(tmp_path, objects, match):
    run = session(tmp_path)
    try:
        with pytest.raises(UsageError, match=match):
            run.track(**objects)
    finally:
        run.close()


def test_a_checkpoint_from_another_world_size_is_refused_with_the_fix(tmp_path):
    run = session(tmp_path)
    run.track(model=nn.Linear(2, 1))
    run.fingerprint["world_size"] = 4  # as if 4 ranks had saved it
    run.save()
    run.close()
    again = session(tmp_path)
    again.track(model=nn.Linear(2, 1))
    with pytest.raises(IncompatibleResume, match=r"saved by 4 ranks, this run has 1.*same nodes x GPUs \(4 ranks\)"):
        again.resume()
    again.close()
    assert list((tmp_path / "checkpoints").glob("step-*"))  # nothing lost


def test_a_checkpoint_beyond_the_schedule_or_missing_a_state_is_refused(tmp_path):
    run = session(tmp_path)
    run.track(model=nn.Linear(2, 1))
    run.progress.step = 999
    run.save()
    run.close()
    again = session(tmp_path)
    again.track(model=nn.Linear(2, 1))
    with pytest.raises(BeyondSchedule, match="at step 999, beyond this run's schedule of 10 steps"):
        again.resume(total_steps=10)
    again.close()
    other = session(tmp_path)
    other.track(model=nn.Linear(2, 1), optimizer=torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1))
    with pytest.raises(IncompatibleResume, match="track\\(\\) the same names"):
        other.resume()
    other.close()


def test_a_nan_loss_stops_without_a_checkpoint(tmp_path):
    run = session(tmp_path)
    try:
        with pytest.raises(Diverged, match="the loss is nan at step 1"):
            run.step(float("nan"))
            run.step(1.0)  # where a GPU is visible, step 1's flags are read here (hpc_ddp.trainer.lagged)
        assert not (tmp_path / "checkpoints").exists() or not list((tmp_path / "checkpoints").glob("step-*"))
    finally:
        run.close()


def test_no_run_dir_names_the_fix(monkeypatch):
    monkeypatch.delenv("HPC_DDP_RUN_DIR", raising=False)
    with pytest.raises(UsageError, match="launch with `hpc-ddp submit`, or pass start\\(run_dir=...\\)"):
        Session(env=from_environ({}, pid=1))


def test_an_uncaught_misuse_in_a_script_is_one_line(tmp_path):
    script = tmp_path / "misuse.py"
    script.write_text("import hpc_ddp\nrun = hpc_ddp.start()\nrun.track(model=object())\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={"HPC_DDP_RUN_DIR": str(tmp_path / "run"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "hpc-ddp: error: track(): model=object has no state_dict()/load_state_dict() "
        "HINT: track modules, optimizers, schedulers, or a dict of tensors and numbers"]


def test_loader_workers_the_user_built_survive_slurms_sigterm(tmp_path):
    """Slurm signals every process of a step: a DataLoader worker killed by it would crash the loop
    instead of letting it checkpoint. start() makes every worker ignore the stop signals."""
    script = tmp_path / "workers.py"
    script.write_text(
        "import os, signal, time, torch, hpc_ddp\n"
        "run = hpc_ddp.start()\n"
        "class D(torch.utils.data.Dataset):\n"
        "    def __len__(self): return 64\n"
        "    def __getitem__(self, i): time.sleep(0.02); return os.getpid()\n"
        "it = iter(torch.utils.data.DataLoader(D(), batch_size=2, num_workers=2))\n"
        "for pid in set(next(it).tolist()): os.kill(pid, signal.SIGTERM)\n"
        "time.sleep(0.3)\n"
        "print(len([b for b in it]))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={"HPC_DDP_RUN_DIR": str(tmp_path / "run"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "31"


def test_loader_workers_of_a_cpu_session_run_below_the_rank(tmp_path, monkeypatch):
    """On CPUs the rank's step is what every rank waits on: `run.loader()` workers yield the cores to it
    (hpc_ddp.data.loaders.worker_niceness); a worker_init_fn the user passes is kept as given."""
    from hpc_ddp.data.loaders import CPU_WORKER_NICENESS

    # A CPU session even on a GPU machine (issue 40: there the session picked the GPU, whose workers keep
    # the rank's priority, and the test expected 5).
    monkeypatch.setenv("BACKEND", "gloo")
    run = session(tmp_path)
    assert run.device.type == "cpu"
    try:
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        loader = run.loader(Data(), batch_size=8, num_workers=1)
        batches = iter(loader)
        next(batches)
        (worker,) = batches._workers
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) == min(ours + CPU_WORKER_NICENESS, 19)
        del batches
        own = run.loader(Data(), batch_size=8, num_workers=1, worker_init_fn=print)
        assert own.worker_init_fn is print
    finally:
        run.close()


def test_a_loss_on_a_device_is_not_read_by_the_host_before_the_step(tmp_path):
    """On GPUs the flags are built where the loss is (no host sync); a meta tensor stands in for a CUDA one:
    reading its value on the host would raise."""
    run = session(tmp_path, checkpoint_every_steps=1, checkpoint_every_minutes=0)
    try:
        sent = run.flags(torch.tensor(0.5, device="meta"))
        assert sent.device.type == "meta" and sent.shape == (3,) and sent.dtype == torch.float64
        cpu = run.flags(torch.tensor(0.5))
        assert cpu.tolist() == [0.5, 0.0, 0.0]  # saves every N steps need no agreement: not a flag
        run.checkpoint_every_minutes, run.last_save = 1.0, time.monotonic() - 61
        assert run.flags(0.25).tolist() == [0.25, 0.0, 1.0]  # rank 0's clock: the ranks must agree on it
    finally:
        run._sent = None
        run.close()


# ---- GPU runs read each step's flags one step late (hpc_ddp.trainer.lagged), here on CPU tensors ----

def losses(run_dir) -> dict[int, float]:
    records = hpc_ddp.common.events.read_jsonl(run_dir / "metrics.jsonl")
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), steps  # each step recorded once
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_late_reading_records_every_step_and_trains_the_same(tmp_path):
    now = train(tmp_path / "now", log_every=1, checkpoint_every_steps=5)
    late = train(tmp_path / "late", log_every=1, checkpoint_every_steps=5, lagged=True)
    assert all(torch.equal(now[k], late[k]) for k in now)
    assert losses(tmp_path / "late") == losses(tmp_path / "now") and sorted(losses(tmp_path / "now")) == list(
        range(1, 25))
    saved = sorted(p.name for p in (tmp_path / "late" / "checkpoints").iterdir() if p.name.startswith("step-"))
    # saves every 5 steps are not late: every rank counts steps
    assert saved == ["step-000000015", "step-000000020", "step-000000024"]


@pytest.mark.parametrize("stop_at", [3, 8, 23])
def test_a_stop_read_late_lands_one_step_later_and_resumes_bitwise(tmp_path, stop_at):
    whole = train(tmp_path / "whole", log_every=1)
    with pytest.raises(SystemExit) as stopped:
        train(tmp_path / "cut", stop_at=stop_at, lagged=True, log_every=1)
    assert stopped.value.code == hpc_ddp.REQUEUE_EXIT_CODE
    events = hpc_ddp.common.events.read_jsonl(tmp_path / "cut" / "events.jsonl")
    (requeue,) = [e for e in events if e["event"] == "requeue_requested"]
    assert requeue["step"] == min(stop_at + 1, 24)
    if stop_at + 1 <= 24:  # the stop step's own loss was recorded before the attempt ended
        assert max(losses(tmp_path / "cut")) == stop_at + 1
    resumed = train(tmp_path / "cut", lagged=True, log_every=1)
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert losses(tmp_path / "cut") == losses(tmp_path / "whole")


@pytest.mark.parametrize("every", [0, 2])  # a NaN in a step that is due a checkpoint too
def test_a_nan_read_late_names_its_own_step_and_saves_nothing(tmp_path, every):
    run = session(tmp_path, log_every=1, checkpoint_every_steps=every)
    run._lag_on_cpu = True
    try:
        run.step(1.0)
        with pytest.raises(Diverged, match="the loss is nan at step 2"):
            run.step(float("nan"))
            run.step(1.0)
        assert not list((tmp_path / "checkpoints").glob("step-*"))
    finally:
        run.close()
    assert losses(tmp_path) == {1: 1.0}  # nothing recorded after the NaN, by close() either


def test_an_explicit_save_reads_the_last_steps_flags_first(tmp_path):
    run = session(tmp_path, log_every=1, exit_on_stop=False)
    run._lag_on_cpu = True
    try:
        run.step(1.0)
        run.step(float("nan"))
        with pytest.raises(Diverged, match="at step 2"):
            run.save()
        assert not list((tmp_path / "checkpoints").glob("step-*"))
    finally:
        run.close("Diverged")
    run = session(tmp_path / "stop", log_every=1, exit_on_stop=False)
    run._lag_on_cpu = True
    try:
        run.stop.request("test")
        run.step(1.0)
        run.save()  # reads step 1's flags (the stop) and saves; the stop is not forgotten
        assert run.step(0.5) is True
    finally:
        run.close()
    events = hpc_ddp.common.events.read_jsonl(tmp_path / "stop" / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "requeue_requested"] == [2]


def test_a_requeue_on_demand_is_the_stop_a_pending_flag_asked_for(tmp_path):
    run = session(tmp_path, log_every=1, exit_on_stop=False)
    run._lag_on_cpu = True
    try:
        run.stop.request("test")
        run.step(1.0)
        run.requeue()  # reads step 1's flags (the stop): this requeue is that stop, not one more after it
        assert run.step(0.5) is False
    finally:
        run.close()
    events = hpc_ddp.common.events.read_jsonl(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "requeue_requested"] == [1]


def test_a_checkpoint_due_by_the_clock_is_saved_once_though_read_late(tmp_path):
    run = session(tmp_path, checkpoint_every_minutes=1.0)
    run._lag_on_cpu = True
    try:
        run.step(1.0)
        run.last_save -= 61  # a minute has passed: rank 0 says so in step 2's flags
        for _ in range(4):
            run.step(1.0)
        run.wait_for_checkpoint()
    finally:
        run.close()
    saved = [e["step"] for e in hpc_ddp.common.events.read_jsonl(tmp_path / "events.jsonl")
             if e["event"] == "checkpoint"]
    assert saved == [3]  # read with step 3 (a step late), and not sent again by step 3's own flags


def test_settle_acts_on_a_stop_from_the_last_step_before_other_work(tmp_path):
    run = session(tmp_path, log_every=1, exit_on_stop=False)
    run._lag_on_cpu = True
    try:
        run.step(1.0)
        run.stop.request("test")
        assert run.step(0.5) is False  # step 2's flags (the stop) are not read yet
        assert max(losses(tmp_path)) == 1
        assert run.settle() is True  # e.g. before an evaluation: read, recorded, checkpointed at step 2
        assert run.settle() is False
    finally:
        run.close()
    events = hpc_ddp.common.events.read_jsonl(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "requeue_requested"] == [2]
    assert losses(tmp_path) == {1: 1.0, 2: 0.5}


def test_close_after_an_error_records_no_late_step(tmp_path):
    run = session(tmp_path, log_every=1)
    run._lag_on_cpu = True
    run.step(1.0)
    run.step(0.5)
    run.close("RuntimeError: a collective failed")
    assert losses(tmp_path) == {1: 1.0}


def test_a_loop_that_ends_without_finish_still_records_its_last_step(tmp_path):
    run = session(tmp_path, log_every=1)
    run._lag_on_cpu = True
    run.step(0.5)
    run.step(0.25)
    assert max(losses(tmp_path)) == 1
    run.close()
    assert losses(tmp_path) == {1: 0.5, 2: 0.25}


def test_lagged_flags_hand_back_the_push_before():
    from hpc_ddp.trainer.lagged import LaggedFlags

    lag = LaggedFlags()
    assert lag.push(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64), "a") is None
    assert lag.push(torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64), "b") == ("a", [1.0, 0.0, 0.0])
    flags = torch.tensor([3.0, 0.0, 1.0], dtype=torch.float64)
    assert lag.push(flags, "c") == ("b", [2.0, 1.0, 0.0])
    flags.fill_(9.0)  # the copy was taken at push time
    assert lag.drain() == ("c", [3.0, 0.0, 1.0]) and lag.drain() is None and not lag.pending
    lag.push(flags, "d")
    lag.discard()
    assert lag.drain(timeout=0) is None


def test_a_late_flags_copy_that_never_lands_is_dropped_after_the_timeout():
    from hpc_ddp.trainer.lagged import LaggedFlags

    class Stuck:  # an event behind a failed collective
        def query(self):
            return False

    lag = LaggedFlags()
    lag._pending = ("a", torch.zeros(3, dtype=torch.float64), Stuck())
    with pytest.raises(TimeoutError):
        lag.drain(timeout=0.05)
    assert not lag.pending


def test_a_gpu_job_on_gloo_says_it_trains_on_the_cpu(tmp_path, monkeypatch, capsys):
    """A job that asked for GPUs, on a rank that sees one, but told gloo (a hidden driver, a stray
    BACKEND): the rank trains on the CPU, and says so rather than being 50x slower without a word."""
    monkeypatch.setenv("BACKEND", "gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    run = Session(tmp_path, env=from_environ({}, pid=1))
    run.gpus_asked = 4
    try:
        run.setup()
        assert run.device.type == "cpu"
    finally:
        run.close()
    assert "asked for 4 GPU(s) per node and this rank sees 1, but BACKEND is 'gloo'" in capsys.readouterr().err
