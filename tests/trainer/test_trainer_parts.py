"""The trainer's pure and in-process parts: config validation, sampling positions, seeded samples,
models, the stop flag, and the single-process `hpc-ddp train` path."""

import os
import pickle
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from hpc_ddp.common.errors import SpecError
from hpc_ddp.data.loaders import ResumableSampler, SeededSamples
from hpc_ddp.spec.jobspec import Layer, Target, build_spec
from hpc_ddp.spec.trainconfig import TrainConfig, parse_train
from hpc_ddp.trainer.models import build_model
from hpc_ddp.trainer.stopping import StopFlag


@pytest.mark.parametrize("table,message", [
    ({"epochs": 0}, "epochs: 0 is below the minimum of 1"),
    ({"lr": 0}, "lr: 0.0 must be greater than 0"),
    ({"optimizer": "lbfgs"}, "not one of sgd, adamw"),
    ({"precision": "fp8"}, "not one of auto, fp32, bf16, fp16"),
    ({"batchsize": 3}, "unknown key 'batchsize' (did you mean 'batch_size'?)"),
    ({"keep_checkpoints": 1}, "keep_checkpoints: 1 is below the minimum of 2"),
    ({"dataset": "mnist"}, "needs data_dir"),
    ({"model": "../evil"}, "not a model name"),
    ({"sync_bn": "yes"}, "not true or false"),
])
def test_train_table_errors(table, message):
    with pytest.raises(ValueError) as info:
        parse_train(table)
    assert message in str(info.value)


def test_train_table_in_a_job_spec_and_flag_overrides():
    layers = [Layer("job file 'j.toml'", {"train": {"epochs": 3, "lr": 0.1, "model": "resnet18"}}),
              Layer("command line", {"epochs": "5"}, is_cli=True)]
    spec = build_spec(layers, target=Target("trainer", "/j.toml"), workdir="/", python="py")
    assert spec.train == TrainConfig(epochs=5, lr=0.1, model="resnet18")
    with pytest.raises(SpecError, match=r"job file 'j.toml': train: epochs: 0 is below"):
        build_spec([Layer("job file 'j.toml'", {"train": {"epochs": 0}})], target=Target("trainer", "/j.toml"),
                   workdir="/", python="py")


def test_train_table_with_a_script_is_refused():
    with pytest.raises(SpecError, match="configures the built-in trainer"):
        build_spec([Layer("j", {"train": {}})], target=Target("script", "/t.py"), workdir="/", python="py")


def test_resumable_sampler_continues_the_same_order():
    full = ResumableSampler(100, rank=1, world_size=2, seed=3)
    full.set_position(epoch=4, start=0)
    order = list(full)
    later = ResumableSampler(100, rank=1, world_size=2, seed=3)
    later.set_position(epoch=4, start=17)
    assert list(later) == order[17:] and len(later) == len(order) - 17
    other_epoch = ResumableSampler(100, rank=1, world_size=2, seed=3)
    other_epoch.set_position(epoch=5, start=0)
    assert [i for _, i in other_epoch] != [i for _, i in order]
    assert all(e == 4 for e, _ in order) and len(order) == 50


class _Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.rand(3)  # stands in for a random augmentation


def test_seeded_samples_depend_only_on_seed_epoch_index():
    ds = SeededSamples(_Noisy(), seed=7)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = ds[(2, 5)]
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG stream is untouched
    torch.manual_seed(999)
    assert torch.equal(ds[(2, 5)], a)
    assert not torch.equal(ds[(3, 5)], a) and not torch.equal(ds[(2, 6)], a)
    assert not torch.equal(SeededSamples(_Noisy(), seed=8)[(2, 5)], a)


class _NoisyEverywhere(_Noisy):
    def __getitem__(self, i):
        import random

        return torch.tensor([torch.rand(1).item(), random.random(), float(np.random.rand())])


def test_a_batch_is_the_same_in_the_main_process_and_in_workers_and_keeps_the_callers_streams():
    """__getitems__ saves the caller's streams once per batch (not per sample): same samples either way."""
    import random

    keys = [(1, i) for i in (3, 1, 4, 1, 5, 9)]
    batch = lambda workers: next(iter(torch.utils.data.DataLoader(  # noqa: E731
        SeededSamples(_NoisyEverywhere(), seed=2), batch_size=6, sampler=keys, num_workers=workers,
        generator=torch.Generator())))  # as the trainer's: starting the loader draws from no caller stream
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
    main = batch(0)
    assert torch.equal(torch.get_rng_state(), states[0]) and random.getstate() == states[1]
    assert (np.random.get_state()[1] == states[2]).all()
    assert torch.equal(main, batch(2))
    assert torch.equal(main[1], main[3])  # the same key, the same draws
    assert torch.equal(main[0], SeededSamples(_NoisyEverywhere(), seed=2)[(1, 3)])


@pytest.mark.parametrize("name,channels,size", [("cnn", 1, 28), ("mlp", 3, 16), ("resnet18", 1, 28),
                                                ("resnet18", 3, 32)])
def test_models_accept_their_inputs(name, channels, size):
    model = build_model(name, num_classes=10, in_channels=channels, image_size=size).eval()
    assert model(torch.zeros(2, channels, size, size)).shape == (2, 10)


def test_user_model_factory(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(
        "import torch\ndef tiny(num_classes, in_channels, image_size):\n"
        "    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(in_channels*image_size**2, num_classes))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model("mymodels:tiny", num_classes=4, in_channels=1, image_size=8)
    assert model(torch.zeros(1, 1, 8, 8)).shape == (1, 4)
    with pytest.raises(SpecError, match="cannot load model factory"):
        build_model("mymodels:nothing", num_classes=4, in_channels=1, image_size=8)
    with pytest.raises(SpecError, match="unknown model 'resnet9000'"):
        build_model("resnet9000", num_classes=4, in_channels=3, image_size=8)


def test_stop_flag_only_sets_a_flag():
    flag = StopFlag(("USR2", "TERM")).install()
    try:
        assert not flag.requested and flag.still_installed() == []
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.requested and flag.received == "SIGUSR2"
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # someone replaces our handler
        assert flag.still_installed() == ["TERM"]
    finally:
        flag.uninstall()


def test_train_command_single_process_and_inspect(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('[train]\ndataset = "fake"\nfake_size = 64\nimage_size = 8\nmodel = "mlp"\nbatch_size = 16\n'
                   'num_workers = 0\nlog_every = 1\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
    done = subprocess.run([sys.executable, "-m", "hpc_ddp", "train", "--run-dir", "run", str(job)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "training finished at step 4" in done.stderr
    info = subprocess.run([sys.executable, "-m", "hpc_ddp", "inspect", str(tmp_path / "run")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert "step            4" in info.stdout and "verified        True" in info.stdout


@pytest.mark.parametrize("train", [
    {"precision": "bf16", "optimizer": "adamw", "lr": 0.001},
    {"precision": "fp16", "grad_accum": 2, "clip_grad": 1.0},
    {"precision": "fp32", "schedule": "constant", "warmup_steps": 2, "max_steps": 3},
])
def test_training_variants_run_in_process(tmp_path, train):
    from hpc_ddp.common.events import read_jsonl
    from hpc_ddp.job.distenv import from_environ
    from hpc_ddp.trainer.train import run

    table = {"dataset": "fake", "fake_size": 64, "image_size": 8, "model": "cnn", "batch_size": 8,
             "num_workers": 0, "log_every": 1, **train}
    spec = build_spec([Layer("job", {"train": table})], target=Target("trainer", "/j.toml"), workdir=str(tmp_path),
                      python=sys.executable)
    assert run(spec, tmp_path, from_environ({})) == 0
    steps = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    expected = train.get("max_steps") or 64 // 8 // train.get("grad_accum", 1)
    assert [r["step"] for r in steps] == list(range(1, expected + 1))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in steps)
    if train.get("warmup_steps"):
        assert steps[0]["lr"] == pytest.approx(0.1 * 2 / 2) and steps[1]["lr"] == pytest.approx(0.1)


def test_the_trainer_trains_on_generated_cifar10(tmp_path):
    """Generated CIFAR-10 reads through SyntheticCIFAR10 (a TypeError there went unnoticed for a while)."""
    from hpc_ddp.common.events import read_jsonl
    from hpc_ddp.data.datagen import write_cifar10
    from hpc_ddp.job.distenv import from_environ
    from hpc_ddp.trainer.train import run

    data = write_cifar10(tmp_path / "cifar", train=48, test=16)
    table = {"dataset": "cifar10", "data_dir": str(data), "model": "cnn", "batch_size": 16, "num_workers": 0,
             "log_every": 1, "epochs": 1}
    spec = build_spec([Layer("job", {"train": table})], target=Target("trainer", "/j.toml"), workdir=str(tmp_path),
                      python=sys.executable)
    assert run(spec, tmp_path, from_environ({})) == 0
    records = list(read_jsonl(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert any("eval_acc" in r for r in records)


@pytest.mark.parametrize("niceness", [0, 3])
def test_loader_workers_survive_stop_signals(tmp_path, niceness):
    """Slurm sends SIGTERM/SIGUSR2 to every process of a step; the workers must not die of it. With a
    niceness they also run that much below this process (the trainer's CPU runs), and only they do."""
    from hpc_ddp.data.loaders import build_data

    cfg = TrainConfig(dataset="fake", fake_size=64, image_size=8, batch_size=8, num_workers=2)
    bundle = build_data(cfg, rank=0, world_size=1, pin_memory=False, worker_niceness=niceness)
    bundle.sampler.set_position(0, 0)
    batches = iter(bundle.train)
    next(batches)
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    for worker in batches._workers:
        assert os.getpriority(os.PRIO_PROCESS, worker.pid) == min(ours + niceness, 19)
        os.kill(worker.pid, signal.SIGTERM)
        os.kill(worker.pid, signal.SIGUSR2)
    assert sum(1 for _ in batches) == 7  # the rest of the epoch still arrives
    assert os.getpriority(os.PRIO_PROCESS, 0) == ours


def test_loader_workers_yield_to_their_rank_on_cpus_only():
    from hpc_ddp.data.loaders import CPU_WORKER_NICENESS, ignore_stop_signals, worker_init, worker_niceness

    assert worker_niceness("cpu") == CPU_WORKER_NICENESS > 0
    assert worker_niceness("cuda") == 0
    assert worker_init(0) is ignore_stop_signals
    assert pickle.loads(pickle.dumps(worker_init(5))).keywords == {"niceness": 5}  # spawn workers unpickle it


def test_the_trainer_on_a_cpu_lowers_its_loader_workers(tmp_path):
    from hpc_ddp.data.loaders import CPU_WORKER_NICENESS
    from hpc_ddp.job.distenv import from_environ
    from hpc_ddp.trainer.session import Session
    from hpc_ddp.trainer.train import Trainer

    cfg = TrainConfig(dataset="fake", fake_size=64, image_size=8, batch_size=8, num_workers=1)
    with Session(tmp_path, env=from_environ({}, pid=1)).setup() as session:
        trainer = Trainer(cfg, session)
        try:
            assert session.device.type == "cpu"
            assert trainer.data.train.worker_init_fn.keywords == {"niceness": CPU_WORKER_NICENESS}
        finally:
            trainer.close()
