"""hpc_ddp.data.arrays: samples made from MNIST's and CIFAR-10's arrays are bitwise the ones torchvision's PIL
transforms give, random draws included, and the trainer's loader uses them only where that holds."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_ddp.data import datagen
from hpc_ddp.data.arrays import ArrayImages
from hpc_ddp.data.loaders import _MEAN_STD, SeededSamples, _crop_padding, _datasets, _seed_all, _transforms
from hpc_ddp.spec.trainconfig import TrainConfig

torch = pytest.importorskip("torch")
D = pytest.importorskip("torchvision.datasets")


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sets")
    mnist = datagen.write_mnist(root / "mnist", train=64, test=16)
    cifar = datagen.write_cifar10(root / "cifar", train=64, test=16)
    return {"mnist": (D.MNIST(str(mnist), train=True, download=False), 1, 28),
            "cifar10": (datagen.SyntheticCIFAR10(str(cifar), train=True), 3, 32)}


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
@pytest.mark.parametrize("augment", [True, False])
def test_each_sample_is_bitwise_torchvisions(sets, name, augment):
    base, channels, size = sets[name]
    reference = _transforms(channels, size, train=True, augment=augment)
    mean, std = _MEAN_STD[channels]
    ours = ArrayImages.of(base, mean=mean, std=std, padding=_crop_padding(size) if augment else 0,
                          flip=augment and channels == 3)
    assert len(ours) == len(base)
    crops = set()
    for seed in range(200):  # enough draws to meet every crop offset and both flips
        index = seed % len(base)
        _seed_all(seed)
        image, target = base[index]
        want = reference(image)
        _seed_all(seed)
        got, got_target = ours[index]
        assert got.dtype == want.dtype and got.shape == want.shape == (channels, size, size)
        assert torch.equal(got, want), (seed, index)
        assert got_target == target and type(got_target) is int
        crops.add(tuple(got[0].flatten().tolist()[:5]))
    assert len(crops) > (20 if augment else 0)  # augmentation did vary the samples


def test_torch_is_the_only_generator_it_draws_from(sets):
    """What lets SeededSamples reseed only torch's generator for it."""
    base, _, _ = sets["cifar10"]
    ours = ArrayImages.of(base, mean=(0.5,) * 3, std=(0.25,) * 3, padding=4, flip=True)
    assert ours.torch_rng_only
    import random
    torch.manual_seed(3)
    first = [ours[i][0] for i in range(8)]
    torch.manual_seed(3)
    random.seed(99)
    np.random.seed(99)
    assert all(torch.equal(a, ours[i][0]) for i, a in enumerate(first))


def test_seeded_samples_reseed_torch_only_for_array_sets(sets, monkeypatch):
    import hpc_ddp.data.loaders as loaders

    base, _, _ = sets["mnist"]
    arrays = SeededSamples(ArrayImages.of(base, mean=(0.5,), std=(0.5,), padding=3), seed=1)
    pil = SeededSamples(base, seed=1)
    called = []
    monkeypatch.setattr(loaders, "_seed_all", lambda seed: called.append(seed))
    arrays._seed(5)
    assert called == []
    pil._seed(5)
    assert called == [5]


def test_rejects_what_is_not_an_image_array():
    with pytest.raises(ValueError, match="uint8"):
        ArrayImages(np.zeros((4, 8, 8), dtype=np.float32), [0] * 4, mean=(0.5,), std=(0.5,))
    with pytest.raises(ValueError, match="3 targets"):
        ArrayImages(np.zeros((4, 8, 8), dtype=np.uint8), [0] * 3, mean=(0.5,), std=(0.5,))


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_the_trainer_uses_arrays_at_the_native_size_and_pil_when_resized(tmp_path, name):
    data = getattr(datagen, f"write_{name}")(tmp_path / name, train=32, test=8)
    native = TrainConfig(dataset=name, data_dir=str(data))
    (train, evaluation), _, _, _ = _datasets(native)
    assert isinstance(train, ArrayImages) and train.padding > 0
    assert isinstance(evaluation, ArrayImages) and evaluation.padding == 0 and not evaluation.flip
    (train, _), _, _, size = _datasets(TrainConfig(dataset=name, data_dir=str(data), image_size=20))
    assert not isinstance(train, ArrayImages) and train.transform is not None
    assert train[0][0].shape[-1] == size == 20
