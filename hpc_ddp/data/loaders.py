"""Training data for the built-in trainer: torchvision datasets from local files, and sampling that can
resume from any sample of any epoch with the same random streams.

Exactness rests on two pieces:
- `ResumableSampler`: DistributedSampler's permutation for (seed, epoch), skipping the first `start`
  indices of this rank's share; it yields (epoch, index) keys.
- `SeededSamples`: each sample's random augmentation is drawn from a seed that depends only on
  (seed, epoch, index), so it does not matter which worker loads it, whether workers are persistent,
  or where in the epoch a resumed run starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, get_worker_info

from hpc_ddp.common.errors import SpecError
from hpc_ddp.data.arrays import ArrayImages
from hpc_ddp.data.augment import sample_seed
from hpc_ddp.data.elastic import Split, rank_share, split_share
from hpc_ddp.spec.trainconfig import TrainConfig

__all__ = ["DataBundle", "build_data", "shutdown_workers", "ResumableSampler", "SeededSamples", "EvalSampler",
           "worker_init", "worker_niceness"]

_MEAN_STD = {1: ((0.5,), (0.5,)), 3: ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))}


@dataclasses.dataclass
class DataBundle:
    train: DataLoader                  # or the device path's batches (data.devicebatches), which wrap one
    eval: DataLoader | None
    sampler: "ResumableSampler"
    num_classes: int
    in_channels: int
    image_size: int
    micro_batches_per_epoch: int
    root: Path | None = None           # where the data was read from (the staged copy, if any)


class SeededSamples(Dataset):
    """Wraps a dataset so `ds[(epoch, i)]` draws its augmentation from seed(seed, epoch, i).

    The caller's RNG state is left as it was (fork_rng), so loading in the main process
    (num_workers=0) does not disturb the training RNG streams.
    """

    def __init__(self, base: Dataset, seed: int):
        self.base, self.seed = base, seed
        # A set that draws only from torch (arrays.py) needs neither python's nor numpy's streams reseeded
        # or kept: that was 80% of the reseeding's cost.
        self.torch_only = bool(getattr(base, "torch_rng_only", False))

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key):
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list) -> list:
        """The samples at `keys`: DataLoader asks for a batch at once. A loader worker just reseeds per
        sample: its RNG streams serve nothing else. The main process (num_workers=0) keeps the caller's
        streams as they were, saving them once per batch: saving and restoring python's and numpy's took
        136 µs, several times a sample's own cost."""
        if get_worker_info() is not None:
            return [self._load(key) for key in keys]
        with torch.random.fork_rng(devices=[]):
            if self.torch_only:
                return [self._load(key) for key in keys]
            py_state, np_state = random.getstate(), np.random.get_state()
            try:
                return [self._load(key) for key in keys]
            finally:
                random.setstate(py_state)
                np.random.set_state(np_state)

    def _load(self, key):
        epoch, index = key if isinstance(key, tuple) else (0, key)
        self._seed(sample_seed(self.seed, epoch, index))
        return self.base[index]

    def _seed(self, seed: int) -> None:
        # default_generator.manual_seed is ~70x cheaper than torch.manual_seed.
        if self.torch_only:
            torch.default_generator.manual_seed(seed)
        else:
            _seed_all(seed)


def _seed_all(seed: int) -> None:
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (2**32))


class ResumableSampler(Sampler):
    """This rank's share of DistributedSampler's shuffled order for an epoch, from a position in it.
    It yields (epoch, index) keys for `SeededSamples`, or plain indices with keys=False.

    The share is taken from the epoch's global order (`data.elastic`): from `consumed` samples of it on,
    this rank's every world_size-th. With an unchanged world size that is DistributedSampler's own share
    from its `consumed / world_size`-th entry; with another one (a resume on fewer or more ranks) it goes on
    with the same global order where the run left it."""

    def __init__(self, size: int, *, rank: int, world_size: int, seed: int, shuffle: bool = True,
                 keys: bool = True):
        self.inner = DistributedSampler(range(size), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                        seed=seed, drop_last=True)
        self.size, self.rank, self.world_size, self.seed, self.shuffle = size, rank, world_size, seed, shuffle
        self.epoch, self.start, self.keys = 0, 0, keys
        self.split: Split | None = None   # an uneven split of the global batch (data.elastic), once resumed so
        self._consumed: int | None = None

    @property
    def consumed(self) -> int:
        """Samples of the epoch's global order before this rank's next one (every rank's together)."""
        return self._consumed if self._consumed is not None else self.start * self.world_size

    def set_position(self, epoch: int, start: int) -> None:
        """Start `epoch` at this rank's `start`-th sample (all ranks at theirs: start x world_size consumed)."""
        self.epoch, self.start, self._consumed = epoch, start, None
        self.inner.set_epoch(epoch)

    def place(self, epoch: int, consumed: int, split: Split) -> None:
        """Start `epoch` at `consumed` samples of its global order (a whole number of steps), the ranks
        sharing each step as `split` says: uneven splits (data.elastic.Split) deal the step's positions in
        rounds; an even one is `set_position`'s interleaving, exactly."""
        self.split = None if split.even else split
        if self.split is None:
            self.set_position(epoch, consumed // self.world_size)
        else:
            self.epoch, self.start, self._consumed = epoch, 0, consumed
            self.inner.set_epoch(epoch)

    def order(self) -> list[int]:
        """The epoch's global order: DistributedSampler's permutation (seed + epoch), whatever the world size."""
        if not self.shuffle:
            return list(range(self.size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=generator).tolist()

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler's call, so loops written for it run unchanged: the epoch the sampler was
        positioned in (a resumed one) keeps its start; any other epoch starts at its beginning."""
        if epoch != self.epoch:
            if self.split is not None:
                self.place(epoch, 0, self.split)
            else:
                self.set_position(epoch, 0)

    def _positions(self):
        if self.split is not None:
            return split_share(self.size, self.consumed, self.rank, self.split)
        return rank_share(self.size, self.consumed, self.rank, self.world_size)

    def __iter__(self) -> Iterator[tuple[int, int]] | Iterator[int]:
        order = self.order()
        indices = [order[p] for p in self._positions()]
        return iter([(self.epoch, i) for i in indices] if self.keys else indices)

    def __len__(self) -> int:
        return len(self._positions())


class EvalSampler(Sampler):
    """Every sample exactly once across ranks (rank, rank+world, ...): no padding, so summed counts are exact."""

    def __init__(self, size: int, rank: int, world_size: int):
        self.indices = list(range(rank, size, world_size))

    def __iter__(self):
        return iter((0, i) for i in self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def _crop_padding(size: int) -> int:
    return max(size // 8, 1)


def _transforms(channels: int, size: int, train: bool, augment: bool):
    from torchvision import transforms as T

    mean, std = _MEAN_STD[channels]
    steps = []
    if train and augment:
        steps += [T.RandomCrop(size, padding=_crop_padding(size)), T.RandomHorizontalFlip()] if channels == 3 else \
            [T.RandomCrop(size, padding=_crop_padding(size))]
    steps += [T.ToTensor(), T.Normalize(mean, std)]
    return T.Compose(steps)


def _resized(channels: int, size: int, native: int, train: bool, augment: bool):
    from torchvision import transforms as T

    pipeline = _transforms(channels, size, train, augment)
    return pipeline if size == native else T.Compose([T.Resize(size), pipeline])


def _folder_transforms(size: int, train: bool, augment: bool):
    """An ImageFolder's: RandomResizedCrop and a flip for training (drawing from torch's generator, which
    SeededSamples seeds per sample: the decisions `augment.resized_crop_decisions` takes on the device
    path); otherwise the central square, resized."""
    from torchvision import transforms as T

    mean, std = _MEAN_STD[3]
    steps = [T.RandomResizedCrop(size), T.RandomHorizontalFlip()] if train and augment else \
        [T.Resize(size), T.CenterCrop(size)]
    return T.Compose([*steps, T.ToTensor(), T.Normalize(mean, std)])


def _images(base, channels: int, size: int, native: int, train: bool, augment: bool):
    """An MNIST or CIFAR10 set with the trainer's transforms: done on its arrays at the native size (the
    same samples, bitwise, for a fifth of the CPU: arrays.py), through PIL when resized."""
    if size != native:
        base.transform = _resized(channels, size, native, train, augment)
        return base
    mean, std = _MEAN_STD[channels]
    crop = train and augment
    return ArrayImages.of(base, mean=mean, std=std, padding=_crop_padding(size) if crop else 0,
                          flip=crop and channels == 3)


def _datasets(cfg: TrainConfig):
    """(train, eval, num_classes, channels, image_size) read from local files; nothing is downloaded."""
    import torchvision.datasets as D

    root = Path(_staged(cfg.data_dir)) if cfg.data_dir else None
    if cfg.dataset == "tokens":  # the gpt model's: windows of block_size tokens (data.tokens)
        from hpc_ddp.data.tokens import TokenWindows, vocab_size

        splits = (TokenWindows(root / "train.bin", cfg.block_size), TokenWindows(root / "val.bin", cfg.block_size))
        return splits, vocab_size(root, cfg.num_classes), 1, cfg.block_size
    if cfg.dataset == "mnist":
        size = cfg.image_size or 28
        make = lambda train: _images(D.MNIST(str(root), train=train, download=False),  # noqa: E731
                                     1, size, 28, train, cfg.augment)
        return _opened(make, cfg), 10, 1, size
    if cfg.dataset == "cifar10":
        size = cfg.image_size or 32
        return _opened(lambda train: _images(_cifar10(root, train), 3, size, 32, train, cfg.augment), cfg), 10, 3, size
    if cfg.dataset == "imagefolder":
        size = cfg.image_size or 32
        make = lambda train: D.ImageFolder(str(root / ("train" if train else "val")),  # noqa: E731
                                           transform=_folder_transforms(size, train, cfg.augment))
        (train, val) = _opened(make, cfg)
        return (train, val), len(train.classes), 3, size
    size = cfg.image_size or 32
    classes = cfg.num_classes or 10
    make = lambda train: D.FakeData(cfg.fake_size if train else max(cfg.fake_size // 4, 1),  # noqa: E731
                                    (3, size, size), classes, transform=_transforms(3, size, False, False),
                                    random_offset=0 if train else 1_000_000)
    return (make(True), make(False)), classes, 3, size


def _staged(data_dir: str) -> str:
    """The node-local copy of data_dir when the job staged it (the runner says where), else data_dir."""
    import json
    import os

    staged = json.loads(os.environ.get("HPC_DDP_STAGED") or "{}")
    return staged.get(str(Path(data_dir).resolve()), data_dir)


def _cifar10(root: Path, train: bool):
    import torchvision.datasets as D

    try:
        return D.CIFAR10(str(root), train=train, download=False)
    except RuntimeError:
        # Generated data cannot match the real set's md5 sums; its own recorded sums are checked instead.
        from hpc_ddp.data.datagen import SyntheticCIFAR10

        return SyntheticCIFAR10(str(root), train=train)


def _opened(make, cfg: TrainConfig):
    try:
        return make(True), make(False)
    except (RuntimeError, FileNotFoundError) as exc:
        raise SpecError(f"cannot read the {cfg.dataset} dataset in {cfg.data_dir!r}: {exc}",
                        hint="make one with `hpc-ddp make-dataset` or fix data_dir") from None


def ignore_stop_signals(_worker_id: int) -> None:
    """Slurm signals every process of a step, loader workers included. A worker killed by SIGTERM or
    SIGUSR2 makes the main process raise instead of checkpointing; the main process decides when
    workers end, so they ignore these."""
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


# How much lower the loader workers of a CPU run are scheduled than their rank. On CPUs the ranks and their
# workers share the cores; the step is the path every rank waits on (each all-reduce waits for the slowest
# rank), while workers only need to stay a batch ahead. At equal priority the kernel gives a worker as much
# CPU as its rank, so prefetching delays the step; at nice 5 the rank gets about 3x a worker's share when
# both want the core, and a worker still gets every cycle the rank leaves (a rank waiting for data leaves
# them all). bench/README.md has the measurements (equal priority, nice 5, nice 10).
CPU_WORKER_NICENESS = 5


def worker_niceness(device_type: str) -> int:
    """The niceness increment for a loader's workers: `CPU_WORKER_NICENESS` on CPUs, 0 elsewhere. Not on
    GPUs: there the main process mostly waits for the device (CUDA's wait may spin on a core), and the
    workers' decoding is what keeps the GPU fed."""
    return CPU_WORKER_NICENESS if device_type == "cpu" else 0


def worker_init(niceness: int = 0):
    """A DataLoader `worker_init_fn`: ignore the stop signals and, with `niceness`, run the worker that much
    lower than its rank (Linux applies it to the worker's thread, and the threads it starts inherit it).
    A partial, not a closure, so `spawn` workers can unpickle it."""
    return functools.partial(_init_worker, niceness=niceness) if niceness else ignore_stop_signals


def _init_worker(worker_id: int, niceness: int) -> None:
    ignore_stop_signals(worker_id)
    with contextlib.suppress(OSError):  # a sandbox refusing setpriority: the worker keeps its rank's priority
        os.nice(niceness)


def _worker_signal_handlers_ignoring_stops(*args, **kwargs):
    """torch's own worker signal set-up (it puts a C handler on SIGTERM), then the stop signals ignored."""
    _TORCH_WORKER_HANDLERS(*args, **kwargs)
    ignore_stop_signals(0)


_TORCH_WORKER_HANDLERS = torch.utils.data._utils.signal_handling._set_worker_signal_handlers


def shield_loader_workers() -> None:
    """Make every DataLoader worker started from now on ignore Slurm's stop signals, loaders the user
    built included: Slurm signals every process of a step, and a worker killed by SIGTERM makes its
    loader raise in the main process instead of letting it checkpoint. Each worker calls torch's
    `_set_worker_signal_handlers` (looked up on its module) as it starts, after forking and before
    loading; ours runs it and then ignores the stop signals. (A `spawn` worker imports torch afresh
    and keeps torch's handlers: pass such a loader `worker_init_fn=ignore_stop_signals`.)"""
    torch.utils.data._utils.signal_handling._set_worker_signal_handlers = _worker_signal_handlers_ignoring_stops


def torchvision_folder():
    from torchvision.datasets import ImageFolder

    return ImageFolder


def shutdown_workers(loader: DataLoader | None) -> None:
    """Stop a loader's (persistent) workers now. They ignore SIGTERM, so the terminate() that
    multiprocessing would send at interpreter exit cannot end them: the trainer ends them here. (A device
    path's batches wrap their loader.)"""
    loader = getattr(loader, "loader", loader)
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        loader._iterator = None


def device_path_fits(cfg: TrainConfig) -> tuple[bool, bool]:
    """(native_size, jpegs): MNIST/CIFAR asked at their own image size; an ImageFolder whose first training
    file is a JPEG (the device path decodes JPEGs only). What `trainer.speed.decide` needs for "auto"."""
    native = {"mnist": 28, "cifar10": 32}.get(cfg.dataset)
    jpegs = False
    if cfg.dataset == "imagefolder" and cfg.data_dir:
        train = Path(_staged(cfg.data_dir)) / "train"
        first = next((f for d in sorted(train.iterdir()) if d.is_dir() for f in sorted(d.iterdir()) if f.is_file()),
                     None) if train.is_dir() else None
        if first is not None:
            with open(first, "rb") as fh:
                jpegs = fh.read(2) == b"\xff\xd8"
    return native is not None and cfg.image_size in (None, native), jpegs


def _device_train(train_set, cfg: TrainConfig, sampler: ResumableSampler, device: torch.device,
                  channels_last: bool, workers: dict):
    """The training batches of the device path: loader workers read bytes (ImageFolder) or draw only the
    decisions (MNIST/CIFAR arrays); the rank decodes and augments on `device` (data.devicebatches)."""
    from hpc_ddp.data.devicebatches import ArrayBatches, ArrayDecisions, DeviceBatches, JpegFiles, collate_jpegs

    fixed = torch.Generator().manual_seed(cfg.seed)
    if isinstance(train_set, ArrayImages):
        decisions = ArrayDecisions(train_set.targets, cfg.seed, train_set.padding, train_set.flip)
        loader = DataLoader(decisions, batch_size=cfg.batch_size, sampler=sampler, drop_last=True, generator=fixed,
                            **workers)
        mean, std = train_set.mean.flatten().tolist(), train_set.std.flatten().tolist()
        return ArrayBatches(loader, train_set.images, device, train_set.padding, mean, std, channels_last)
    files = JpegFiles(train_set.samples, cfg.seed, cfg.augment)
    loader = DataLoader(files, batch_size=cfg.batch_size, sampler=sampler, drop_last=True, generator=fixed,
                        collate_fn=collate_jpegs, **workers)
    mean, std = _MEAN_STD[3]
    return DeviceBatches(loader, device, cfg.image_size or 32, mean, std, channels_last)


def build_data(cfg: TrainConfig, *, rank: int, world_size: int, pin_memory: bool, worker_niceness: int = 0,
               data_path: str = "cpu", device: torch.device | None = None, channels_last: bool = False) -> DataBundle:
    """The training and evaluation data of this rank. `data_path` "device": training batches are decoded and
    augmented on `device` (evaluation keeps the CPU path: it runs once an epoch)."""
    (train_set, eval_set), classes, channels, size = _datasets(cfg)
    sampler = ResumableSampler(len(train_set), rank=rank, world_size=world_size, seed=cfg.seed)
    workers = dict(num_workers=cfg.num_workers, persistent_workers=cfg.num_workers > 0, pin_memory=pin_memory,
                   worker_init_fn=worker_init(worker_niceness) if cfg.num_workers else None)
    if data_path == "device" and not isinstance(train_set, (ArrayImages, torchvision_folder())):
        raise SpecError(f"data_path = \"device\" has no device path for the {cfg.dataset} data at image_size "
                        f"{cfg.image_size}", hint='set data_path = "cpu" (or "auto") in the [train] table')
    # A fixed generator: creating the iterator must not draw from the training RNG streams.
    train = _device_train(train_set, cfg, sampler, device or torch.device("cpu"), channels_last, workers) \
        if data_path == "device" else \
        DataLoader(SeededSamples(train_set, cfg.seed), batch_size=cfg.batch_size, sampler=sampler,
                   drop_last=True, generator=torch.Generator().manual_seed(cfg.seed), **workers)
    evaluation = None
    if cfg.eval_every_epoch and len(eval_set):
        evaluation = DataLoader(SeededSamples(eval_set, cfg.seed), batch_size=cfg.batch_size,
                                sampler=EvalSampler(len(eval_set), rank, world_size),
                                generator=torch.Generator().manual_seed(cfg.seed), **workers)
    micro = len(sampler.inner) // cfg.batch_size
    if micro < cfg.grad_accum:
        raise SpecError(f"the {cfg.dataset} training set gives each of {world_size} rank(s) only {micro} batch(es) "
                        f"of {cfg.batch_size}, fewer than grad_accum={cfg.grad_accum}",
                        hint="use a smaller batch_size or grad_accum, or more data")
    root = Path(_staged(cfg.data_dir)) if cfg.data_dir else None
    return DataBundle(train, evaluation, sampler, cfg.num_classes or classes, channels, size, micro, root)
