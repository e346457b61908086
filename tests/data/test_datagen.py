"""hpc_ddp.data.datagen: the generated datasets load through torchvision's own classes and are learnable."""

from __future__ import annotations

import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hpc_ddp.common.errors import UserError
from hpc_ddp.data import datagen

torch = pytest.importorskip("torch")
torchvision = pytest.importorskip("torchvision")

SMALL = {
    "mnist": {"train": 60, "test": 20},
    "imagefolder": {"classes": 4, "per_class_train": 5, "per_class_val": 2, "size": 16},
    "cifar10": {"train": 53, "test": 20},  # not a multiple of 5: uneven batches
}


def generate(fmt: str, root: Path, **overrides) -> Path:
    return datagen.GENERATORS[fmt](root, **{**SMALL[fmt], **overrides})


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def stats(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def test_import_does_not_import_torch():
    code = "import sys, hpc_ddp.data.datagen; sys.exit(any(m.split('.')[0] == 'torch' for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_generators_table():
    assert datagen.GENERATORS == {"mnist": datagen.write_mnist, "imagefolder": datagen.write_imagefolder,
                                  "cifar10": datagen.write_cifar10, "tokens": datagen.write_tokens}


# --- each format through torchvision's reader -----------------------------------------------------

def test_mnist_loads_with_torchvision(tmp_path):
    assert datagen.write_mnist(tmp_path, train=60, test=20) == tmp_path
    for train, n in ((True, 60), (False, 20)):
        ds = torchvision.datasets.MNIST(tmp_path, train=train, download=False)
        assert len(ds) == n
        assert ds.data.shape == (n, 28, 28) and ds.data.dtype == torch.uint8
        assert set(ds.targets.tolist()) == set(range(10))
        image, label = ds[0]
        assert image.size == (28, 28) and image.mode == "L" and 0 <= label < 10


def test_mnist_idx_headers_are_exact(tmp_path):
    datagen.write_mnist(tmp_path, train=60, test=20)
    raw = tmp_path / "MNIST" / "raw"
    images = (raw / "train-images-idx3-ubyte").read_bytes()
    labels = (raw / "t10k-labels-idx1-ubyte").read_bytes()
    assert struct.unpack(">IIII", images[:16]) == (2051, 60, 28, 28) and len(images) == 16 + 60 * 784
    assert struct.unpack(">II", labels[:8]) == (2049, 20) and len(labels) == 8 + 20
    assert sorted(p.name for p in raw.iterdir()) == sorted(
        f"{s}-{k}" for s in ("train", "t10k") for k in ("images-idx3-ubyte", "labels-idx1-ubyte"))


@pytest.mark.parametrize("channels, mode", [(3, "RGB"), (1, "L")])
def test_imagefolder_loads_with_torchvision(tmp_path, channels, mode):
    datagen.write_imagefolder(tmp_path, classes=4, per_class_train=5, per_class_val=2, size=16,
                              channels=channels)
    for split, per_class in (("train", 5), ("val", 2)):
        ds = torchvision.datasets.ImageFolder(tmp_path / split)
        assert ds.classes == ["class_0", "class_1", "class_2", "class_3"]
        assert len(ds) == 4 * per_class
        assert sorted(ds.targets) == sorted(list(range(4)) * per_class)  # balanced
        path, _ = ds.samples[0]
        with Image.open(path) as png:
            assert (png.size, png.mode) == ((16, 16), mode)
        image, _ = ds[0]
        assert image.size == (16, 16) and image.mode == "RGB"  # ImageFolder's loader converts


def test_cifar10_loads_with_synthetic_subclass(tmp_path):
    datagen.write_cifar10(tmp_path, train=53, test=20)
    from hpc_ddp.data.datagen import SyntheticCIFAR10
    assert issubclass(SyntheticCIFAR10, torchvision.datasets.CIFAR10)
    for train, n in ((True, 53), (False, 20)):
        ds = SyntheticCIFAR10(tmp_path, train=train)
        assert len(ds) == n and ds.data.shape == (n, 32, 32, 3) and ds.data.dtype == np.uint8
        assert set(ds.targets) == set(range(10))
        assert ds.classes == list(datagen.CIFAR10_CLASSES)
        image, label = ds[0]
        assert image.size == (32, 32) and image.mode == "RGB" and 0 <= label < 10
    # DataLoader workers under spawn/forkserver pickle the dataset.
    assert pickle.loads(pickle.dumps(ds)).targets == ds.targets


def test_cifar10_stock_class_rejects_generated_files_by_md5(tmp_path):
    # Why SyntheticCIFAR10 exists: torchvision pins the md5 sums of the real CIFAR-10 files.
    datagen.write_cifar10(tmp_path, train=53, test=20)
    with pytest.raises(RuntimeError, match="not found or corrupted"):
        torchvision.datasets.CIFAR10(tmp_path, train=True, download=False)


def test_cifar10_integrity_check_still_catches_corruption(tmp_path):
    datagen.write_cifar10(tmp_path, train=53, test=20)
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    batch.write_bytes(batch.read_bytes()[:-1] + b"\0")
    with pytest.raises(RuntimeError, match="corrupted"):
        datagen.SyntheticCIFAR10(tmp_path, train=True)


def test_cifar10_pickles_read_like_the_real_files(tmp_path):
    # The CIFAR site's recipe reads with encoding="bytes" and gets bytes keys (torchvision's
    # encoding="latin1" gets str keys; the loading tests above cover that).
    datagen.write_cifar10(tmp_path, train=53, test=20)
    folder = tmp_path / "cifar-10-batches-py"
    with open(folder / "data_batch_1", "rb") as f:
        batch = pickle.load(f, encoding="bytes")
    assert set(batch) == {b"batch_label", b"labels", b"data", b"filenames"}
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape == (11, 3072)
    assert batch[b"batch_label"] == b"training batch 1 of 5" and len(batch[b"labels"]) == 11
    sizes = []
    for i in range(1, 6):
        with open(folder / f"data_batch_{i}", "rb") as f:
            sizes.append(len(pickle.load(f, encoding="latin1")["labels"]))
    assert sizes == [11, 11, 11, 10, 10]
    with open(folder / "batches.meta", "rb") as f:
        assert pickle.load(f, encoding="bytes")[b"label_names"][0] == b"airplane"


# --- determinism, idempotence, publishing ---------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(SMALL))
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, fmt):
    a = tree(generate(fmt, tmp_path / "a", seed=3))
    assert a == tree(generate(fmt, tmp_path / "b", seed=3))
    other = tree(generate(fmt, tmp_path / "c", seed=4))
    unchanged = {name for name in a if other.get(name) == a[name]}
    assert unchanged <= {"cifar-10-batches-py/batches.meta"}  # class names do not depend on the seed


@pytest.mark.parametrize("fmt", sorted(SMALL))
def test_second_call_leaves_the_dataset_alone(tmp_path, fmt):
    root = generate(fmt, tmp_path / "d")
    before = stats(tmp_path)
    assert generate(fmt, tmp_path / "d") == root
    assert stats(tmp_path) == before


@pytest.mark.parametrize("fmt", sorted(SMALL))
def test_no_temporary_directories_left(tmp_path, fmt):
    generate(fmt, tmp_path / "d")
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_different_parameters_on_an_existing_dataset_are_refused(tmp_path):
    datagen.write_mnist(tmp_path, train=60, test=20)
    with pytest.raises(UserError, match="different generated dataset"):
        datagen.write_mnist(tmp_path, train=60, test=20, seed=1)


def test_foreign_data_is_never_overwritten(tmp_path):
    real = tmp_path / "MNIST" / "raw" / "train-images-idx3-ubyte"
    real.parent.mkdir(parents=True)
    real.write_bytes(b"the user's real MNIST")
    with pytest.raises(UserError, match="not written by"):
        datagen.write_mnist(tmp_path, train=60, test=20)
    assert real.read_bytes() == b"the user's real MNIST"


def test_an_empty_target_directory_is_filled(tmp_path):
    (tmp_path / "cifar-10-batches-py").mkdir()
    datagen.write_cifar10(tmp_path, train=53, test=20)
    assert len(datagen.SyntheticCIFAR10(tmp_path, train=False)) == 20


def test_losing_a_race_to_a_concurrent_writer_is_fine(tmp_path, monkeypatch):
    # Another writer (here: a nested call) publishes while this one is still generating; this one's
    # rename then fails and it must return the winner's dataset instead of raising.
    real_samples, raced = datagen._samples, []

    def samples_with_a_rival(*args, **kwargs):
        if not raced:
            raced.append(True)
            datagen.write_mnist(tmp_path, train=60, test=20)
        return real_samples(*args, **kwargs)

    monkeypatch.setattr(datagen, "_samples", samples_with_a_rival)
    assert datagen.write_mnist(tmp_path, train=60, test=20) == tmp_path
    assert raced and len(torchvision.datasets.MNIST(tmp_path, train=True)) == 60
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize("kwargs", [{"train": 0}, {"test": -1}, {"train": 2.5}])
def test_bad_counts_are_user_errors(tmp_path, kwargs):
    with pytest.raises(UserError):
        datagen.write_mnist(tmp_path, **{"train": 60, "test": 20, **kwargs})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("kwargs", [{"classes": 1}, {"channels": 2}, {"per_class_val": 0}, {"size": 4}])
def test_bad_imagefolder_arguments_are_user_errors(tmp_path, kwargs):
    with pytest.raises(UserError):
        datagen.write_imagefolder(tmp_path / "d", **kwargs)


# --- learnability ---------------------------------------------------------------------------------

def best_single_pixel_accuracy(x: np.ndarray, y: np.ndarray, xt: np.ndarray, yt: np.ndarray,
                               bins: int = 16) -> float:
    """Test accuracy of the best classifier that looks at one (binned) pixel only."""
    a, at = (x.reshape(len(x), -1) // (256 // bins)), (xt.reshape(len(xt), -1) // (256 // bins))
    pixels = np.arange(a.shape[1])
    counts = np.zeros((a.shape[1], bins, 10))
    np.add.at(counts, (pixels[None, :], a, y[:, None]), 1)
    guess = counts.argmax(axis=2)[pixels[None, :], at]  # (test samples, pixels)
    return float((guess == yt[:, None]).mean(axis=0).max())


@pytest.mark.extended
def test_mnist_format_data_is_learnable_but_not_trivial(tmp_path):
    datagen.write_mnist(tmp_path, train=2000, test=500)
    train = torchvision.datasets.MNIST(tmp_path, train=True)
    test = torchvision.datasets.MNIST(tmp_path, train=False)
    assert best_single_pixel_accuracy(train.data.numpy(), train.targets.numpy(),
                                      test.data.numpy(), test.targets.numpy()) < 0.3

    torch.manual_seed(0)
    x, y = train.data.float().div(255).unsqueeze(1), train.targets
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(16 * 4 * 4, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(150):  # about five epochs of 2000 images, a second or two on CPU
        batch = torch.randint(0, len(x), (64,))
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        accuracy = (model(test.data.float().div(255).unsqueeze(1)).argmax(1) == test.targets).float().mean()
    assert accuracy > 0.8
