"""MNIST and CIFAR-10 samples made from their in-memory arrays, without PIL.

torchvision's MNIST and CIFAR10 read the whole set into one uint8 array. For each sample they make a PIL
image of it and run the PIL transforms: RandomCrop with padding, RandomHorizontalFlip, ToTensor,
Normalize. On a 2-core VM that is about 120 µs a sample, mostly PIL and per-call overhead, not
arithmetic. `ArrayImages` runs the same steps on the array. It draws the same random numbers from torch,
in the same order, so each sample is bitwise the one torchvision's pipeline gives
(tests/data/test_arrays.py checks this), at about a fifth of the CPU.

This matters on CPU runs, where loader workers share the cores with the ranks: CPU a worker does not
spend goes to the training step. Resized sets (`image_size` other than the native size) keep the PIL
pipeline, because Resize on PIL images is not the same computation as on arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ["ArrayImages"]


class ArrayImages(Dataset):
    """`images[i]` (uint8, H x W or H x W x C) as torchvision's RandomCrop(size, padding) [+
    RandomHorizontalFlip()] + ToTensor() + Normalize(mean, std) would give it, with `targets[i]`."""

    # What SeededSamples needs to reseed per sample: only torch's generator (no python or numpy draws).
    torch_rng_only = True

    def __init__(self, images: np.ndarray, targets: Sequence[int], *, mean: Sequence[float],
                 std: Sequence[float], padding: int = 0, flip: bool = False):
        if images.ndim == 3:  # MNIST: N x H x W
            images = images[..., None]
        if images.dtype != np.uint8 or images.ndim != 4 or len(images) != len(targets):
            raise ValueError(f"need N x H x W [x C] uint8 images and N targets, got {images.dtype} "
                             f"{images.shape} and {len(targets)} targets")
        self.images, self.targets = images, [int(t) for t in targets]
        self.padding, self.flip = padding, flip
        # Normalize's own tensors: float32, one value per channel, shaped to broadcast over H x W.
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)

    @classmethod
    def of(cls, base: Dataset, *, mean: Sequence[float], std: Sequence[float], padding: int = 0,
           flip: bool = False) -> "ArrayImages":
        """From a torchvision MNIST (`data` a uint8 tensor) or CIFAR10 (`data` a numpy array)."""
        data = base.data  # type: ignore[attr-defined]
        images = data.numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
        targets = base.targets  # type: ignore[attr-defined]
        return cls(images, targets.tolist() if isinstance(targets, torch.Tensor) else targets,
                   mean=mean, std=std, padding=padding, flip=flip)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = self.images[index]
        if self.padding:
            image = self._random_crop(image)
        if self.flip and torch.rand(1) < 0.5:  # RandomHorizontalFlip(p=0.5)'s one draw
            image = image[:, ::-1]
        chw = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))
        return chw.float().div_(255).sub_(self.mean).div_(self.std), self.targets[index]

    def _random_crop(self, image: np.ndarray) -> np.ndarray:
        """RandomCrop(size=H x W, padding=p): zero-pad every side by p, then a crop of the original size at a
        place drawn as RandomCrop.get_params draws it (top, then left, each from torch.randint)."""
        p = self.padding
        h, w, c = image.shape
        padded = np.zeros((h + 2 * p, w + 2 * p, c), dtype=np.uint8)
        padded[p:p + h, p:p + w] = image
        top = int(torch.randint(0, 2 * p + 1, size=(1,)))
        left = int(torch.randint(0, 2 * p + 1, size=(1,)))
        return padded[top:top + h, left:left + w]
