"""Random augmentation as a function of (seed, epoch, index): the decisions (where to crop, whether to
flip) are drawn here, once, from a generator seeded by the sample's own seed; the pixels are then moved
by whichever path runs: PIL in a loader worker (the CPU path) or batched tensor ops on the rank's device
(the GPU path, `data.devicebatches`). Both paths take the same decisions for the same sample, so a run
resumes exactly whichever path it uses, and the two can be compared on CPU, in CI.

- `sample_seed(seed, epoch, index)`: the one per-sample seed (`loaders.SeededSamples` draws from it too).
- `crop_box(generator, height, width)`: RandomResizedCrop's box, drawn as torchvision's `get_params` draws
  it (two uniforms per try, then two randints), from `generator` instead of the global stream.
- `resized_crop_decisions(seed, epoch, index, height, width)`: (top, left, h, w, flip) for ImageFolder.
- `pad_crop_decisions(seed, epoch, index, padding, flip)`: (top, left, flip) for MNIST/CIFAR arrays, the
  draws `arrays.ArrayImages` makes after `SeededSamples` reseeds torch's default generator.
- `normalize`, `resized_crops`, `flip_where`, `pad_crops`: the batched pixel work, on any device.

No host synchronisation: decisions are Python ints made on the CPU (in loader workers); the device gets
them as tensors copied without blocking.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["SCALE", "RATIO", "sample_seed", "crop_box", "resized_crop_decisions", "pad_crop_decisions",
           "normalize", "resized_crops", "flip_where", "pad_crops"]

SCALE = (0.08, 1.0)          # RandomResizedCrop's defaults: the area kept, and the aspect ratios drawn
RATIO = (3 / 4, 4 / 3)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed sample `index` of `epoch` draws its augmentation from (it does not depend on the rank,
    the worker, the world size or where in the epoch a resumed run starts)."""
    return (seed * 1_000_003 + epoch * 7_919 + index) % (2**63)


def crop_box(generator: torch.Generator, height: int, width: int, scale: Sequence[float] = SCALE,
             ratio: Sequence[float] = RATIO) -> tuple[int, int, int, int]:
    """(top, left, h, w): torchvision's RandomResizedCrop.get_params, drawing from `generator`."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1], generator=generator)).item()
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
            return top, left, h, w
    in_ratio = width / height  # the fallback: a central crop of the allowed aspect ratio
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def resized_crop_decisions(seed: int, epoch: int, index: int, height: int, width: int,
                           augment: bool = True) -> tuple[int, int, int, int, bool]:
    """(top, left, h, w, flip) for sample `index` of `epoch` of an image of height x width: a random resized
    crop and a horizontal flip with p=0.5 (RandomResizedCrop, then RandomHorizontalFlip); without `augment`,
    the central square crop and no flip."""
    if not augment:
        side = min(height, width)
        return (height - side) // 2, (width - side) // 2, side, side, False
    generator = torch.Generator().manual_seed(sample_seed(seed, epoch, index))
    top, left, h, w = crop_box(generator, height, width)
    return top, left, h, w, bool(torch.rand(1, generator=generator).item() < 0.5)


def pad_crop_decisions(seed: int, epoch: int, index: int, padding: int, flip: bool) -> tuple[int, int, bool]:
    """(top, left, flip) of RandomCrop(size, padding) [+ RandomHorizontalFlip()] for sample `index` of
    `epoch`: the draws ArrayImages makes (top, left, then the flip's one uniform) from torch's generator
    seeded with the sample's seed."""
    generator = torch.Generator().manual_seed(sample_seed(seed, epoch, index))
    top = int(torch.randint(0, 2 * padding + 1, size=(1,), generator=generator)) if padding else 0
    left = int(torch.randint(0, 2 * padding + 1, size=(1,), generator=generator)) if padding else 0
    flipped = flip and bool(torch.rand(1, generator=generator) < 0.5)
    return top, left, flipped


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 N x C x H x W -> float32, as ToTensor() + Normalize(mean, std) compute it (divide by 255, then
    subtract and divide per channel): bitwise the CPU path's values on the same device."""
    m = torch.as_tensor(mean, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=images.device).view(1, -1, 1, 1)
    return images.float().div_(255).sub_(m).div_(s)


def flip_where(images: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """Each image of N x C x H x W mirrored left-right where `flips` (N bools, on the images' device) says."""
    return torch.where(flips.view(-1, 1, 1, 1), images.flip(-1), images)


def resized_crops(images: Sequence[torch.Tensor], boxes: Sequence[Sequence[int]], size: int) -> torch.Tensor:
    """uint8 C x H_i x W_i images (any sizes, one device) cropped to their boxes (top, left, h, w) and
    resized to size x size with antialiasing, as one uint8 N x C x size x size batch. Each crop is a view;
    each resize one kernel; nothing waits for the device."""
    from torchvision.transforms.v2 import functional as F

    out = [F.resized_crop(image, top, left, h, w, [size, size], antialias=True)
           for image, (top, left, h, w) in zip(images, boxes)]
    return torch.stack(out)


def pad_crops(images: torch.Tensor, tops: torch.Tensor, lefts: torch.Tensor, padding: int) -> torch.Tensor:
    """RandomCrop(size=H x W, padding) of a uint8 N x C x H x W batch: each image zero-padded by `padding`
    and cut at its own (top, left) (N ints each, on the images' device), by one gather."""
    n, c, h, w = images.shape
    if not padding:
        return images
    padded = torch.nn.functional.pad(images, (padding, padding, padding, padding))
    rows = (tops.view(n, 1) + torch.arange(h, device=images.device).view(1, h))        # N x H
    cols = (lefts.view(n, 1) + torch.arange(w, device=images.device).view(1, w))       # N x W
    index_rows = rows.view(n, 1, h, 1).expand(n, c, h, w + 2 * padding)
    picked = padded.gather(2, index_rows)                                              # N x C x H x (W+2p)
    return picked.gather(3, cols.view(n, 1, 1, w).expand(n, c, h, w))
