"""The device data path: loader workers only read bytes and draw the augmentation decisions; the rank
decodes and augments whole batches on its device (a GPU: nvjpeg through torchvision's `decode_jpeg`, then
batched tensor ops), so PIL never holds the GPU back.

- ImageFolder of JPEGs: `JpegFiles` yields (file bytes, label, crop box, flip) per (epoch, index) key, the
  box drawn from the JPEG's header size by `augment.resized_crop_decisions`; `DeviceBatches` decodes the
  batch with `decode_jpeg(list, device=...)`, crops and resizes each image (antialiased), flips and
  normalizes the batch.
- MNIST/CIFAR arrays: `ArrayDecisions` yields (index, top, left, flip, label); `ArrayBatches` keeps the
  whole uint8 array on the device and gathers, pads, crops, flips and normalizes each batch there. On
  the same device the values are bitwise those of `arrays.ArrayImages` (tests/data/test_devicebatches.py).

Both wrap a DataLoader whose sampler is the run's ResumableSampler, so positions, resume and the
sample stream are the CPU path's. Runs on any device: CI runs it on CPU; `make test-gpu` on CUDA with
synchronisation debug mode "error" (no step waits for the host).

The decode runs on a stream of its own (`DecodeStream`, issue 40). torchvision's batched nvjpeg decode
allocates its output images from the *caller's* stream and writes them on a private stream that does not
wait for the caller's (nvjpeg's hardware engine would not honour such a wait either). The caching allocator
hands a block back out as soon as it is freed on its stream, so the decoder was given memory that the
previous step's queued kernels (activations, gradients) were still to read, and wrote pixels into it: the
trainer's loss was NaN from step 4 on a GPU, while batches looked right whenever anything synchronised.
Now the outputs are allocated while an idle side stream is current (no queued kernel can still use what
its pool hands out), the rank's stream waits for the side stream, and each image is recorded as used by
the rank's stream, so its memory is not handed out again before the crops that read it have run.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from hpc_ddp.common.errors import SpecError
from hpc_ddp.data import augment

__all__ = ["jpeg_size", "JpegFiles", "collate_jpegs", "DecodeStream", "DeviceBatches", "ArrayDecisions",
           "ArrayBatches"]

# Start-of-frame markers carry the image's size (SOF0..SOF15, but DHT C4, JPG C8 and DAC CC).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_HEADER_BYTES = 1 << 16       # a SOF marker sits in the first few KB (after EXIF/ICC segments)


def jpeg_size(data: bytes) -> tuple[int, int]:
    """(height, width) from a JPEG's start-of-frame segment, without decoding. ValueError if `data` is not
    a JPEG (or its frame header is not within what was read)."""
    if data[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG file (no start-of-image marker)")
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            raise ValueError(f"not a JPEG file (no marker at byte {pos})")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # markers without a length
            pos += 2
            continue
        (length,) = struct.unpack(">H", data[pos + 2:pos + 4])
        if marker in _SOF:
            if pos + 9 > len(data):
                break
            height, width = struct.unpack(">HH", data[pos + 5:pos + 9])
            if not height or not width:
                raise ValueError("JPEG frame header gives a zero size")
            return height, width
        pos += 2 + length
    raise ValueError("no JPEG frame header found")


class JpegFiles(Dataset):
    """An ImageFolder's (path, label) samples as (bytes, label, (top, left, h, w), flip) for (epoch, index)
    keys: what a loader worker does on the device path is read the file and draw the decisions."""

    def __init__(self, samples: Sequence[tuple[str, int]], seed: int, augment: bool = True):
        self.samples, self.seed, self.augment = list(samples), seed, augment

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        path, label = self.samples[index]
        data = Path(path).read_bytes()
        try:
            height, width = jpeg_size(data[:_HEADER_BYTES])
        except ValueError as exc:
            raise SpecError(f"{path}: {exc}: the device data path decodes JPEGs only",
                            hint='set data_path = "cpu" in the job\'s [train] table for other formats') from None
        *box, flip = augment.resized_crop_decisions(self.seed, epoch, index, height, width, self.augment)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8), label, box, flip


def collate_jpegs(items):
    """A batch of JpegFiles items: (list of byte tensors, labels, boxes N x 4, flips N)."""
    data, labels, boxes, flips = zip(*items)
    return list(data), torch.tensor(labels), torch.tensor(boxes, dtype=torch.int64), torch.tensor(flips)


class CudaStreams:
    """The few CUDA stream operations `DecodeStream` needs, behind one small interface (tests/data give a
    model of them to check the order on machines without a GPU)."""

    def new(self, device: torch.device):
        return torch.cuda.Stream(device=device)

    def current(self, device: torch.device):
        return torch.cuda.current_stream(device)

    def using(self, stream):
        return torch.cuda.stream(stream)

    def wait(self, waiter, waited) -> None:
        waiter.wait_stream(waited)

    def record(self, tensor: torch.Tensor, stream) -> None:
        tensor.record_stream(stream)


class DecodeStream:
    """Runs a batched decode whose library writes on a stream of its own (torchvision's nvjpeg decode) so
    that its outputs never share memory with work still queued on the rank's stream; see the module's
    docstring. On a CPU it just calls the decode."""

    def __init__(self, device: torch.device, streams=None):
        self.device = torch.device(device)
        self.streams = streams if streams is not None else (CudaStreams() if self.device.type == "cuda" else None)
        self.side = self.streams.new(self.device) if self.streams is not None else None

    def decode(self, decode: Callable[[], Sequence[torch.Tensor]]) -> Sequence[torch.Tensor]:
        if self.streams is None:
            return decode()
        main = self.streams.current(self.device)
        with self.streams.using(self.side):   # the outputs come from the idle side stream's pool
            images = decode()
        self.streams.wait(main, self.side)    # torchvision made the side stream wait for the decode
        for image in images:                  # not handed out again before the rank's kernels read it
            self.streams.record(image, main)
        return images


def _decode_jpegs(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    from torchvision.io import ImageReadMode, decode_jpeg

    return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)


class DeviceBatches:
    """Iterate a JpegFiles loader as (images, labels) on `device`: decoded there, cropped and resized to
    `size`, flipped and normalized; channels_last if asked. Has the loader's length and sampler.
    `decode(data, device)` and `streams` are torchvision's decode and CUDA's streams unless a test says."""

    def __init__(self, loader: DataLoader, device: torch.device, size: int, mean: Sequence[float],
                 std: Sequence[float], channels_last: bool = False, *, decode=None, streams=None):
        self.loader, self.device, self.size = loader, torch.device(device), size
        self.mean, self.std, self.channels_last = mean, std, channels_last
        self.sampler = loader.sampler
        self._decode = decode or _decode_jpegs
        self.stream = DecodeStream(self.device, streams)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for data, labels, boxes, flips in self.loader:
            images = self.stream.decode(lambda data=data: self._decode(data, self.device))
            batch = augment.resized_crops(images, boxes.tolist(), self.size)  # boxes are host ints: no sync
            batch = augment.flip_where(batch, flips.to(self.device, non_blocking=True))
            yield self._finish(batch), labels.to(self.device, non_blocking=True)

    def _finish(self, batch: torch.Tensor) -> torch.Tensor:
        out = augment.normalize(batch, self.mean, self.std)
        return out.contiguous(memory_format=torch.channels_last) if self.channels_last else out


class ArrayDecisions(Dataset):
    """MNIST/CIFAR samples as (index, top, left, flip, label) for (epoch, index) keys: the pixels stay on
    the device (`ArrayBatches`); only the decisions are made per sample."""

    def __init__(self, targets: Sequence[int], seed: int, padding: int, flip: bool):
        self.targets, self.seed, self.padding, self.flip = [int(t) for t in targets], seed, padding, flip

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        top, left, flipped = augment.pad_crop_decisions(self.seed, epoch, index, self.padding, self.flip)
        return index, top, left, flipped, self.targets[index]


class ArrayBatches:
    """Iterate an ArrayDecisions loader as (images, labels) on `device`, the uint8 images (N x H x W [x C])
    copied there once."""

    def __init__(self, loader: DataLoader, images: np.ndarray, device: torch.device, padding: int,
                 mean: Sequence[float], std: Sequence[float], channels_last: bool = False):
        if images.ndim == 3:
            images = images[..., None]
        self.loader, self.device, self.padding = loader, torch.device(device), padding
        self.images = torch.from_numpy(np.ascontiguousarray(images.transpose(0, 3, 1, 2))).to(self.device)
        self.mean, self.std, self.channels_last = mean, std, channels_last
        self.sampler = loader.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index, top, left, flips, labels in self.loader:
            move = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
            batch = self.images.index_select(0, move(index))
            batch = augment.pad_crops(batch, move(top), move(left), self.padding)
            batch = augment.flip_where(batch, move(flips))
            out = augment.normalize(batch, self.mean, self.std)
            yield (out.contiguous(memory_format=torch.channels_last) if self.channels_last else out), move(labels)
