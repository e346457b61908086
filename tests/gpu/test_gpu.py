"""What only a GPU shows: the loop never waits for the step it just queued, background checkpoints copy
the GPU state exactly while training goes on, the trainer stops and resumes on a GPU, and each rank gets a
GPU of its own. Skipped where torch sees no GPU (CI has none); `make test-gpu` runs them on a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hpc_ddp.common.events import read_jsonl
from hpc_ddp.job.distenv import from_environ
from hpc_ddp.trainer.session import Session

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible")]

def hpc_ddp(*args: str, cwd: Path, env: dict | None = None, timeout: float = 600):
    return subprocess.run([sys.executable, "-m", "hpc_ddp", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                         nn.Flatten(), nn.Linear(512, 10))


def test_the_loop_never_waits_for_its_own_step_and_background_saves_copy_the_gpu_state(tmp_path):
    """torch.cuda.set_sync_debug_mode("error") raises on every host synchronisation (a .item(), a
    .tolist(), a copy to pageable memory): steps, log records and periodic background saves pass under it.
    The checkpoint written in the background holds exactly the weights of its step, though the loop
    went on changing them while the pinned copies were in flight."""
    run = Session(tmp_path, env=from_environ({}, pid=1), log_every=3, checkpoint_every_steps=4).setup()
    kept: dict[int, dict[str, torch.Tensor]] = {}
    try:
        assert run.device.type == "cuda"
        torch.manual_seed(0)
        model = net().to(run.device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        run.track(model=model, optimizer=opt)
        run.resume(total_steps=10)
        x = torch.randn(64, 3, 32, 32, device=run.device)
        y = torch.randint(0, 10, (64,), device=run.device)
        for step in range(1, 11):
            if step == 3:  # steps 1-2 allocate (cuDNN plans, the optimizer's buffers, the first pinned buffers)
                torch.cuda.set_sync_debug_mode("error")
            loss = nn.functional.cross_entropy(model(x + 0.01 * step), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.step(loss)
            if step in (4, 8):
                kept[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        torch.cuda.set_sync_debug_mode("default")
        run.finish()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        run.close()
    for step, want in kept.items():
        saved = torch.load(tmp_path / "checkpoints" / f"step-{step:09d}" / "model.pt", weights_only=True)
        assert all(torch.equal(saved[k], want[k].cpu()) for k in want), f"checkpoint of step {step} differs"
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [3, 6, 9, 10]
    assert all(0 < r["loss"] < 10 for r in records)
    background = [e for e in read_jsonl(tmp_path / "events.jsonl") if e.get("background")]
    assert [e["step"] for e in background] == [4, 8]


JOB = """
nodes = 1
tasks_per_node = 1
gpus = 1
[train]
dataset = "fake"
model = "resnet18"
image_size = 64
num_classes = 10
fake_size = 512
epochs = 1
batch_size = 32
num_workers = 2
log_every = 1
checkpoint_every_steps = 5
precision = "bf16"
"""


def test_the_trainer_on_a_gpu_stops_late_by_one_step_and_resumes(tmp_path):
    """A stop during step 7 is read with step 8's flags (one step late on GPUs): the checkpoint is at step
    8, the next attempt resumes there, and every step's loss is recorded once."""
    (tmp_path / "job.toml").write_text(JOB)
    done = hpc_ddp("submit", "--executor", "local", "--run-dir", "run", "job.toml", cwd=tmp_path,
                   env={"HPC_DDP_FAULT_STOP_AT": "7"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    start = next(e for e in events if e["event"] == "start")
    assert start["device"] == "cuda:0", start
    assert [e["step"] for e in events if e["event"] == "requeue_requested"] == [8]
    assert [(e["step"], e["device"]) for e in events if e["event"] == "resume"] == [(8, "cuda:0")]
    assert [e["step"] for e in events if e["event"] == "finish"] == [16]
    steps = [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 17))


PROBE = """
import json, os, torch, torch.distributed as dist
import hpc_ddp
with hpc_ddp.start() as run:
    total = torch.ones(1, device=run.device)
    dist.all_reduce(total)
    props = torch.cuda.get_device_properties(run.device)
    seen = {"rank": run.rank, "device": str(run.device), "uuid": str(props.uuid), "sum": total.item(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}
    (run.run_dir / f"rank-{run.rank}.json").write_text(json.dumps(seen))
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_each_rank_gets_a_gpu_of_its_own(tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    done = hpc_ddp("submit", "--executor", "local", "--gpus", "2", "--tasks-per-node", "2", "--run-dir", "run",
                   "probe.py", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = [json.loads((tmp_path / "run" / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [s["sum"] for s in seen] == [2.0, 2.0]  # NCCL, one GPU each (NCCL refuses two ranks on one GPU)
    # the default binding shows both ranks the node's GPUs and starts each on its own
    assert len({s["uuid"] for s in seen}) == 2 and [s["device"] for s in seen] == ["cuda:0", "cuda:1"], seen


RANK_GUARD_PROBE = """
import json, os, sys, torch, torch.distributed as dist
sys.path.insert(0, os.environ["GUARD_DIR"])
import hpc_ddp_rankguard
dist.init_process_group("nccl")  # wrapped by the rank guard: a one-rank group is not checked
x = torch.ones(1, device="cuda")
dist.all_reduce(x)
print(json.dumps({"current": torch.cuda.current_device(), "count": torch.cuda.device_count(),
                  "wrapped": hasattr(dist.init_process_group, "_hpc_ddp_original"),
                  "physical": hpc_ddp_rankguard._physical(torch, 0), "sum": x.item()}))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("start_device", ["0", "1"])
def test_the_rank_guard_on_real_cuda(tmp_path, start_device):
    """The single-GPU path on real CUDA: the start device is queued for CUDA's own lazy start and never fails
    it (index 1 on a one-GPU view is skipped, not a DeferredCudaCallError), init_process_group still works
    wrapped, and a GPU is named by its real UUID."""
    from hpc_ddp.job.runner import EXIT_GUARD_DIR, with_exit_guard

    (tmp_path / "probe.py").write_text(RANK_GUARD_PROBE)
    env = {**os.environ, "PYTHONPATH": with_exit_guard(None), "GUARD_DIR": EXIT_GUARD_DIR,
           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
           "HPC_DDP_CUDA_DEVICE": start_device, "HPC_DDP_GPU_BINDING": "node", "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
    done = subprocess.run([sys.executable, str(tmp_path / "probe.py")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["count"] == 1 and seen["current"] == 0 and seen["wrapped"] and seen["sum"] == 1.0, seen
    assert seen["physical"].startswith(("GPU-", "MIG-")), seen


def test_flags_live_where_the_process_group_does_whatever_device_the_loss_is_on(tmp_path):
    """NCCL all-reduces GPU tensors only: a loss handed over on the CPU (loss.item(), loss.cpu()) still
    gives flags on the rank's GPU."""
    run = Session(tmp_path, env=from_environ({}, pid=1)).setup()
    try:
        for loss in (0.5, torch.tensor(0.5), torch.tensor(0.5, device=run.device), None):
            sent = run.flags(loss)
            assert sent.device == run.device and sent.dtype == torch.float64, loss
            assert sent.tolist()[0] == (0.0 if loss is None else 0.5)
    finally:
        run._sent = None
        run.close()


def test_the_device_data_path_never_waits_for_the_host(tmp_path):
    """Issue 34: ImageFolder JPEGs decoded by nvjpeg and augmented on the GPU, and CIFAR arrays kept on the GPU,
    give batches with no host synchronisation (the decisions are host ints made in the loader)."""
    from torch.utils.data import DataLoader

    from hpc_ddp.data.datagen import write_cifar10, write_imagefolder
    from hpc_ddp.data.devicebatches import ArrayBatches, ArrayDecisions, DeviceBatches, JpegFiles, collate_jpegs
    from hpc_ddp.data.loaders import ResumableSampler

    write_imagefolder(tmp_path / "f", classes=2, per_class_train=16, per_class_val=1, size=64, image_format="jpeg")
    from torchvision.datasets import ImageFolder
    samples = ImageFolder(str(tmp_path / "f" / "train")).samples
    loader = DataLoader(JpegFiles(samples, 0), batch_size=8, sampler=ResumableSampler(len(samples), rank=0,
                        world_size=1, seed=0), collate_fn=collate_jpegs, num_workers=2, pin_memory=True)
    write_cifar10(tmp_path / "c", train=64, test=8)
    from hpc_ddp.data.datagen import SyntheticCIFAR10
    cifar = SyntheticCIFAR10(str(tmp_path / "c"), train=True)
    arrays = DataLoader(ArrayDecisions(cifar.targets, 0, 4, True), batch_size=8,
                        sampler=ResumableSampler(64, rank=0, world_size=1, seed=0), pin_memory=True)
    device = torch.device("cuda")
    # Built first: ArrayBatches copies the whole array to the GPU once, at its start, which does wait
    # (issue 40 saw that copy flagged); what must never wait is each batch.
    paths = (DeviceBatches(loader, device, 56, (0.5,) * 3, (0.25,) * 3, channels_last=True),
             ArrayBatches(arrays, cifar.data, device, 4, (0.5,) * 3, (0.25,) * 3))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for batches in paths:
            for x, y in batches:
                assert x.is_cuda and y.is_cuda and x.dtype == torch.float32
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_decoded_jpegs_never_overwrite_memory_the_ranks_stream_still_reads():
    """Issue 40's cause on real CUDA: torchvision's batched nvjpeg decode allocates its outputs from the
    caller's stream and writes them from its own, so memory freed on the rank's stream while kernels queued
    there still read it could be handed to the decoder and overwritten (the trainer's loss was NaN at step 4).
    Each round queues a long kernel, then a sum of each of N known tensors behind it, frees the tensors and
    decodes through `DecodeStream`: every sum must be exact. (The plain decode's count of wrong sums is
    written where HPC_DDP_GPU_CHECK_NOTES points, for make gpu-check's summary; it is not asserted.)"""
    import io

    from PIL import Image
    from torchvision.io import ImageReadMode, decode_jpeg

    from hpc_ddp.data.devicebatches import DecodeStream

    device = torch.device("cuda")
    size, count, rounds = 96, 16, 30
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), (200, 30, 90)).save(buffer, "JPEG", quality=95)
    data = [torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)] * count
    expected = 7 * 3 * size * size

    def wrong_sums(decode) -> int:
        wrong = 0
        for _ in range(rounds):
            tensors = [torch.full((3, size, size), 7, dtype=torch.uint8, device=device) for _ in range(count)]
            torch.cuda.synchronize()
            torch.cuda._sleep(20_000_000)        # the previous step's kernels, still queued
            sums = [t.sum(dtype=torch.int64) for t in tensors]
            del tensors                          # freed on the rank's stream while the sums wait to read them
            images = decode()
            torch.cuda.synchronize()
            wrong += sum(int(s) != expected for s in sums)
            del images
        return wrong

    stream = DecodeStream(device)
    ours = wrong_sums(lambda: stream.decode(lambda: decode_jpeg(data, mode=ImageReadMode.RGB, device=device)))
    plain = wrong_sums(lambda: decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
    notes = os.environ.get("HPC_DDP_GPU_CHECK_NOTES")
    if notes:
        Path(notes).write_text(json.dumps({"decode_race_rounds": rounds, "decode_race_tensors": count,
                                           "wrong_sums_decode_stream": ours, "wrong_sums_plain_decode": plain}))
    assert ours == 0, f"{ours} of {rounds * count} sums were overwritten by the decode"


FSDP_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fsdp_preemptible.py"


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_sharded_model_on_gpus_stops_resumes_and_exports(tmp_path, ranks):
    """Issue 52 on real CUDA (NCCL): examples/fsdp_preemptible.py, one rank per GPU, stopped at step 45 and
    resumed; its final weights against an uninterrupted run's (bitwise where the kernels are deterministic:
    the hash, else within 1e-5), and `hpc-ddp export` of it loads into the unsharded model."""
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} GPUs")
    runs = {}
    for name, env in (("whole", {}), ("cut", {"HPC_DDP_FAULT_STOP_AT": "45"})):
        done = hpc_ddp("submit", "--executor", "local", "--gpus", str(ranks), "--tasks-per-node", str(ranks),
                       "--run-dir", name, str(FSDP_EXAMPLE), cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        runs[name] = done.stdout + done.stderr
    assert "checkpointing at step" in runs["cut"] and "resumed from" in runs["cut"], runs["cut"][-3000:]
    assert hpc_ddp("export", "whole", "--to", "whole.pt", cwd=tmp_path).returncode == 0
    assert hpc_ddp("export", "cut", "--to", "cut.pt", cwd=tmp_path).returncode == 0
    whole, cut = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("whole", "cut"))
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
    model.load_state_dict(cut)
    equal = all(torch.equal(whole[k], cut[k]) for k in whole)
    close = all(torch.allclose(whole[k], cut[k], rtol=1e-5, atol=1e-6) for k in whole)
    print(f"fsdp on {ranks} GPU(s): resumed weights bitwise equal: {equal}, within 1e-5: {close}")
    assert close
    events = read_jsonl(tmp_path / "cut" / "events.jsonl")
    assert all(e.get("device", "cuda:0").startswith("cuda") for e in events if e["event"] in ("start", "resume"))
