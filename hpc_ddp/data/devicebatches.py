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
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from hpc_ddp.common.errors import SpecError
from hpc_ddp.data import augment

__all__ = ["jpeg_size", "JpegFiles", "collate_jpegs", "DeviceBatches", "ArrayDecisions", "ArrayBatches"]

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


class DeviceBatches:
    """Iterate a JpegFiles loader as (images, labels) on `device`: decoded there, cropped and resized to
    `size`, flipped and normalized; channels_last if asked. Has the loader's length and sampler."""

    def __init__(self, loader: DataLoader, device: torch.device, size: int, mean: Sequence[float],
                 std: Sequence[float], channels_last: bool = False):
        self.loader, self.device, self.size = loader, torch.device(device), size
        self.mean, self.std, self.channels_last = mean, std, channels_last
        self.sampler = loader.sampler

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from torchvision.io import ImageReadMode, decode_jpeg

        for data, labels, boxes, flips in self.loader:
            images = decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
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
