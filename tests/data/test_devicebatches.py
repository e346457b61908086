"""The device data path on CPU, in CI (issue 34): the same augmentation decisions as the CPU path for the
same (seed, epoch, index), the same pixels (bitwise for MNIST/CIFAR arrays; within resampling's rounding
for JPEGs), and JPEG sizes read from headers."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms as T

from hpc_ddp.common.errors import SpecError
from hpc_ddp.data import augment
from hpc_ddp.data.arrays import ArrayImages
from hpc_ddp.data.devicebatches import ArrayBatches, ArrayDecisions, DeviceBatches, JpegFiles, collate_jpegs, jpeg_size
from hpc_ddp.data.loaders import ResumableSampler, SeededSamples

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


@pytest.mark.parametrize("height,width", [(224, 224), (375, 500), (500, 333), (40, 900), (17, 13)])
def test_crop_box_draws_as_torchvision_draws(height, width):
    for seed in range(40):
        torch.manual_seed(seed)
        want = T.RandomResizedCrop.get_params(torch.empty(3, height, width), list(augment.SCALE), list(augment.RATIO))
        assert augment.crop_box(torch.Generator().manual_seed(seed), height, width) == want


def test_the_cpu_path_takes_the_decisions_the_device_path_takes():
    """SeededSamples reseeds torch's generator per sample; torchvision's RandomResizedCrop + RandomHorizontalFlip
    then draw exactly what resized_crop_decisions draws from the sample's seed."""
    for epoch, index in [(0, 0), (0, 7), (3, 1234), (9, 5)]:
        torch.default_generator.manual_seed(augment.sample_seed(11, epoch, index))
        box = T.RandomResizedCrop.get_params(torch.empty(3, 300, 400), list(augment.SCALE), list(augment.RATIO))
        flip = bool(torch.rand(1) < 0.5)
        assert augment.resized_crop_decisions(11, epoch, index, 300, 400) == (*box, flip)


def _jpeg(path, height, width, seed, progressive=False):
    rng = np.random.default_rng(seed)
    pixels = (rng.random((height, width, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels).save(path, "JPEG", quality=95, progressive=progressive)


@pytest.fixture
def folder(tmp_path):
    samples = []
    for i, (h, w) in enumerate([(96, 128), (128, 96), (64, 64), (100, 150), (80, 120), (150, 100)]):
        path = tmp_path / f"img{i}.jpg"
        _jpeg(path, h, w, i, progressive=i % 2 == 1)
        samples.append((str(path), i % 3))
    return samples


def test_jpeg_size_reads_the_frame_header(folder):
    for path, _ in folder:
        with Image.open(path) as image:
            assert jpeg_size(open(path, "rb").read()) == (image.height, image.width)
    buffer = io.BytesIO()
    Image.new("RGB", (7, 5)).save(buffer, "PNG")
    for bad in (buffer.getvalue(), b"", b"\xff\xd8\xff", b"\xff\xd8garbage"):
        with pytest.raises(ValueError):
            jpeg_size(bad)


def test_a_file_that_is_not_a_jpeg_is_one_line(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png", "PNG")
    with pytest.raises(SpecError, match='decodes JPEGs only'):
        JpegFiles([(str(tmp_path / "x.png"), 0)], seed=0)[(0, 0)]


def _cpu_path(samples, keys, size, seed):
    """What the CPU path gives for these keys: PIL decoding and torchvision's transforms, reseeded per sample."""
    from torchvision.datasets.folder import default_loader

    class Folder(torch.utils.data.Dataset):
        transform = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)])

        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            return self.transform(default_loader(samples[i][0])), samples[i][1]
    data = SeededSamples(Folder(), seed)
    return torch.stack([data[k][0] for k in keys])


def test_device_batches_on_cpu_match_the_cpu_path(folder):
    size, seed = 48, 5
    sampler = ResumableSampler(len(folder), rank=0, world_size=1, seed=seed)
    sampler.set_position(2, 0)
    loader = DataLoader(JpegFiles(folder, seed), batch_size=3, sampler=sampler, collate_fn=collate_jpegs)
    got = torch.cat([x for x, _ in DeviceBatches(loader, torch.device("cpu"), size, MEAN, STD)])
    want = _cpu_path(folder, list(sampler), size, seed)
    assert got.shape == want.shape == (6, 3, size, size) and got.dtype == torch.float32
    # The same crops and flips; PIL's and torch's antialiased resampling round differently, by a level or two.
    assert (got - want).abs().mean() < 0.01   # measured 0.0009; wrong crops or flips give 0.46
    labels = torch.cat([y for _, y in DeviceBatches(loader, torch.device("cpu"), size, MEAN, STD)])
    assert labels.tolist() == [folder[i][1] for _, i in sampler]


def test_device_batches_give_channels_last_when_asked(folder):
    loader = DataLoader(JpegFiles(folder, 0), batch_size=2, collate_fn=collate_jpegs)
    x, _ = next(iter(DeviceBatches(loader, torch.device("cpu"), 32, MEAN, STD, channels_last=True)))
    assert x.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("channels,padding,flip", [(1, 3, False), (3, 4, True), (3, 0, False)])
def test_array_batches_are_bitwise_the_cpu_path(channels, padding, flip):
    rng = np.random.default_rng(0)
    shape = (40, 28, 28) if channels == 1 else (40, 32, 32, 3)
    images, targets = rng.integers(0, 256, shape, dtype=np.uint8), list(rng.integers(0, 10, 40))
    mean, std = ((0.5,), (0.5,)) if channels == 1 else (MEAN, STD)
    sampler = ResumableSampler(40, rank=1, world_size=2, seed=3)
    sampler.set_position(4, 5)   # a resumed epoch, mid-way
    cpu = SeededSamples(ArrayImages(images, targets, mean=mean, std=std, padding=padding, flip=flip), 3)
    want = [cpu[k] for k in sampler]
    loader = DataLoader(ArrayDecisions(targets, 3, padding, flip), batch_size=4, sampler=sampler)
    got = list(ArrayBatches(loader, images, torch.device("cpu"), padding, mean, std))
    assert torch.equal(torch.cat([x for x, _ in got]), torch.stack([x for x, _ in want]))
    assert torch.cat([y for _, y in got]).tolist() == [y for _, y in want]


def test_pad_crops_cut_each_image_at_its_own_place():
    images = torch.arange(2 * 1 * 4 * 4, dtype=torch.uint8).view(2, 1, 4, 4)
    out = augment.pad_crops(images, torch.tensor([0, 2]), torch.tensor([1, 2]), 1)
    padded = torch.nn.functional.pad(images, (1, 1, 1, 1))
    assert torch.equal(out[0], padded[0, :, 0:4, 1:5]) and torch.equal(out[1], padded[1, :, 2:6, 2:6])


# ---- the trainer's data: build_data on either path ----

def _cfg(**values):
    from hpc_ddp.spec.trainconfig import parse_train

    return parse_train({"num_workers": 0, "batch_size": 8, **values})


def _batches(cfg, data_path, epoch=1, start=3):
    from hpc_ddp.data.loaders import build_data

    bundle = build_data(cfg, rank=1, world_size=2, pin_memory=False, data_path=data_path,
                        device=torch.device("cpu"))
    bundle.sampler.set_position(epoch, start * cfg.batch_size)
    return list(bundle.train)


def test_cifar_on_the_device_path_is_bitwise_the_cpu_path(tmp_path):
    from hpc_ddp.data.datagen import write_cifar10

    write_cifar10(tmp_path / "c", train=96, test=16)
    cfg = _cfg(dataset="cifar10", data_dir=str(tmp_path / "c"))
    cpu, device = _batches(cfg, "cpu"), _batches(cfg, "device")
    assert len(cpu) == len(device) == 3
    for (xc, yc), (xd, yd) in zip(cpu, device):
        assert torch.equal(xc, xd) and torch.equal(yc, yd)


def test_jpeg_folders_on_the_device_path_match_the_cpu_path(tmp_path):
    from hpc_ddp.data.datagen import write_imagefolder
    from hpc_ddp.data.loaders import device_path_fits

    write_imagefolder(tmp_path / "f", classes=2, per_class_train=24, per_class_val=2, size=40, image_format="jpeg")
    cfg = _cfg(dataset="imagefolder", data_dir=str(tmp_path / "f"), image_size=24)
    assert device_path_fits(cfg) == (False, True)
    cpu, device = _batches(cfg, "cpu", start=1), _batches(cfg, "device", start=1)
    assert len(cpu) == len(device) == 2
    for (xc, yc), (xd, yd) in zip(cpu, device):
        assert xc.shape == xd.shape == (8, 3, 24, 24) and torch.equal(yc, yd)
        assert (xc - xd).abs().mean() < 0.05   # the same crops and flips; resampling rounds apart


def test_a_png_folder_has_no_device_path(tmp_path):
    from hpc_ddp.data.datagen import write_imagefolder
    from hpc_ddp.data.loaders import device_path_fits

    write_imagefolder(tmp_path / "f", classes=2, per_class_train=16, per_class_val=1, size=16)
    cfg = _cfg(dataset="imagefolder", data_dir=str(tmp_path / "f"))
    assert device_path_fits(cfg) == (False, False)
    with pytest.raises(SpecError, match="decodes JPEGs only"):
        _batches(cfg, "device", start=0)


def test_fake_data_has_no_device_path():
    with pytest.raises(SpecError, match='no device path for the fake data'):
        _batches(_cfg(dataset="fake", fake_size=64), "device", start=0)


class StreamModel:
    """A model of what issue 40 was about, for machines without a GPU: CUDA streams as the caching allocator
    sees them. The rank's stream ("main") always has kernels queued (the previous step's), the side stream
    has none. Hazards are recorded where real CUDA would race: a decode whose outputs come from the pool of
    a stream with queued work (the library writes them on a stream of its own, before that work has run);
    pixels used on main before main waited for the decode; a decoded image freed without being recorded as
    used by main (its memory handed out again while main's crops may not have read it yet)."""

    def __init__(self):
        self.stack, self.hazards, self.log = ["main"], [], []
        self.pending: dict[int, dict] = {}   # id(image) -> what happened to it

    # the CudaStreams interface
    def new(self, device):
        return "side"

    def current(self, device):
        return self.stack[-1]

    def using(self, stream):
        model = self

        class _Using:
            def __enter__(self):
                model.stack.append(stream)

            def __exit__(self, *exc):
                model.stack.pop()
        return _Using()

    def wait(self, waiter, waited):
        self.log.append(("wait", waiter, waited))
        for state in self.pending.values():
            if waiter == "main" and waited == state["stream"]:
                state["waited"] = True

    def record(self, tensor, stream):
        self.pending[id(tensor)]["recorded"].add(stream)

    # what the decode library and the consumer do
    def decode(self, data, device):
        stream = self.stack[-1]
        for key, state in list(self.pending.items()):  # the previous batch's images are freed by now
            if state["stream"] != "main" and "main" not in state["recorded"]:
                self.hazards.append("a decoded image was freed to its stream's pool without main recorded on it")
            del self.pending[key]
        if stream == "main":
            self.hazards.append("decoded into memory from a pool whose stream has queued work")
        images = [torch.zeros(3, 8 + i, 8, dtype=torch.uint8) for i in range(len(data))]
        for image in images:
            self.pending[id(image)] = {"stream": stream, "waited": stream == "main", "recorded": set()}
        self.log.append(("decode", stream))
        return images

    def crops(self, real):
        def crops(images, boxes, size):
            for image in images:
                state = self.pending.get(id(image))
                if state is not None and not state["waited"]:
                    self.hazards.append("main read pixels before it waited for the decode")
            return real(images, boxes, size)
        return crops


def _jpeg_batches(folder, model, monkeypatch, **kw):
    monkeypatch.setattr(augment, "resized_crops", model.crops(augment.resized_crops))
    sampler = ResumableSampler(len(folder), rank=0, world_size=1, seed=0)
    loader = DataLoader(JpegFiles(folder, seed=3), batch_size=2, sampler=sampler, collate_fn=collate_jpegs)
    return DeviceBatches(loader, "cpu", 8, MEAN, STD, decode=model.decode, **kw)


def test_decoded_images_come_from_an_idle_stream_and_are_waited_for_and_recorded(folder, monkeypatch):
    """Issue 40's cause, guarded on CPU: the batched decode runs with the idle side stream current, main waits
    for it before the crops read the pixels, and every image is recorded as used by main."""
    model = StreamModel()
    batches = list(_jpeg_batches(folder, model, monkeypatch, streams=model))
    assert len(batches) == 3 and model.hazards == []
    assert [entry for entry in model.log if entry[0] == "decode"] == [("decode", "side")] * 3
    assert model.log[:2] == [("decode", "side"), ("wait", "main", "side")]


def test_the_stream_model_sees_the_race_a_decode_on_the_ranks_stream_had(folder, monkeypatch):
    """The model is not vacuous: the decode as it was before issue 40 (on the caller's stream, as torchvision
    allocates) is reported, batch after batch."""
    model = StreamModel()

    class OnTheRanksStream(StreamModel):   # no side stream: what DeviceBatches did before
        def using(self, stream):
            return model.using("main")

        def current(self, device):
            return "main"

        def wait(self, waiter, waited):
            pass

        def record(self, tensor, stream):
            pass
    list(_jpeg_batches(folder, model, monkeypatch, streams=OnTheRanksStream()))
    assert model.hazards.count("decoded into memory from a pool whose stream has queued work") == 3


def test_a_decode_stream_on_a_cpu_calls_the_decode_and_nothing_else():
    from hpc_ddp.data.devicebatches import DecodeStream

    stream = DecodeStream(torch.device("cpu"))
    assert stream.streams is None and stream.decode(lambda: ["x"]) == ["x"]
