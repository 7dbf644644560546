"""Tiny copies of FEMNIST, CIFAR-10 and Fashion-MNIST in the real on-disk formats, for tests
and smoke runs.

    python -m experiments.fixtures data/fixtures      # writes femnist/, cifar10/, fashion_mnist/

The formats are the ones a user's copy has: a directory written by ``datasets``'
``save_to_disk`` (FEMNIST's columns image/writer_id/hsf_id/character, CIFAR-10's
img/label, images as PNG with ``datasets.Image`` features), parquet files written by
``datasets`` (the hub's layout), and CIFAR-10's python pickles (``cifar-10-batches-py``:
``data_batch_1`` .. ``data_batch_5``, ``test_batch``, ``batches.meta``), and
Fashion-MNIST's four IDX files (gzipped, as distributed, or not, or both in torchvision's
``FashionMNIST/raw``).

The pixels are not handwriting: each class has a fixed random pattern, and each image
is its class pattern plus noise (and a per-writer brightness offset for FEMNIST), so a
model can learn them in a few rounds.
"""

from __future__ import annotations

import argparse
import gzip
import pickle
import string
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

FEMNIST_CLASSES = list(string.digits + string.ascii_uppercase + string.ascii_lowercase)
CIFAR_CLASSES = [
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
]


def class_images(
    labels: np.ndarray, shape: tuple[int, int, int], seed: int, offsets: np.ndarray | None = None
) -> np.ndarray:
    """uint8 images (n, H, W, C): the label's fixed pattern plus noise (plus offsets)."""
    patterns = np.random.default_rng(1000).uniform(0, 1, (int(labels.max()) + 1, *shape))
    rng = np.random.default_rng(seed)
    noise = rng.normal(0, 0.15, (labels.size, *shape))
    img = patterns[labels] + noise
    if offsets is not None:
        img += offsets.reshape(-1, 1, 1, 1)
    return np.clip(img * 255, 0, 255).astype(np.uint8)


def femnist_rows(num_writers: int = 20, seed: int = 0, num_labels: int = 10) -> dict[str, list]:
    """Columns of a FEMNIST-like table: writers with 12..30 samples each, labels among
    the first ``num_labels`` of FEMNIST's 62 classes."""
    rng = np.random.default_rng(seed)
    sizes = [12 + (7 * i) % 19 for i in range(num_writers)]
    writer_ids = [f"f{i:04d}_{(3 * i) % 100:02d}" for i in range(num_writers)]
    writers = np.repeat(np.arange(num_writers), sizes)
    labels = rng.integers(0, num_labels, writers.size)
    offsets = rng.normal(0, 0.05, num_writers)[writers]
    images = class_images(labels, (28, 28, 1), seed, offsets)
    return {
        "image": [img[:, :, 0] for img in images],
        "writer_id": [writer_ids[w] for w in writers],
        "hsf_id": [int(w % 8) for w in writers],
        "character": labels.tolist(),
    }


def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()  # no "Saving the dataset" bars in test logs
    return datasets


def _femnist_dataset(num_writers: int, seed: int):
    datasets = _quiet_datasets()

    features = datasets.Features(
        {
            "image": datasets.Image(),
            "writer_id": datasets.Value("string"),
            "hsf_id": datasets.Value("int64"),
            "character": datasets.ClassLabel(names=FEMNIST_CLASSES),
        }
    )
    return datasets.Dataset.from_dict(femnist_rows(num_writers, seed), features=features)


def write_femnist(root: Path, fmt: str = "disk", num_writers: int = 20, seed: int = 0) -> Path:
    """Write a FEMNIST copy under ``root``; return the path to give ``dataset.path``.

    ``fmt``: "disk" (save_to_disk of the train split, as ``load_dataset(...,
    split="train").save_to_disk`` writes it) or "parquet" (``data/train-*.parquet``).
    """
    ds = _femnist_dataset(num_writers, seed)
    if fmt == "disk":
        path = root / "femnist"
        ds.save_to_disk(str(path))
        return path
    if fmt == "parquet":
        path = root / "femnist_parquet"
        (path / "data").mkdir(parents=True, exist_ok=True)
        ds.to_parquet(str(path / "data" / "train-00000-of-00001.parquet"))
        return path
    raise ValueError(f"fmt={fmt!r}: allowed: disk, parquet")


def cifar_arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (n, 32, 32, 3), labels) with every class present when n >= 10."""
    labels = (np.arange(n) + np.random.default_rng(seed).integers(0, 10)) % 10
    labels = np.random.default_rng(seed + 1).permutation(labels)
    return class_images(labels, (32, 32, 3), seed), labels.astype(np.int64)


def write_cifar10(root: Path, fmt: str = "pickle", per_batch: int = 40, test: int = 40) -> Path:
    """Write a CIFAR-10 copy (5 x ``per_batch`` training and ``test`` test images).

    ``fmt``: "pickle" (torchvision's cifar-10-batches-py), "disk" (save_to_disk of the
    DatasetDict with train and test) or "parquet" (``plain_text/{train,test}-*.parquet``).
    """
    train_x, train_y = cifar_arrays(5 * per_batch, seed=1)
    test_x, test_y = cifar_arrays(test, seed=2)
    if fmt == "pickle":
        path = root / "cifar-10-batches-py"
        path.mkdir(parents=True, exist_ok=True)

        def dump(name: str, x: np.ndarray, y: np.ndarray) -> None:
            batch = {
                b"batch_label": name.encode(),
                b"labels": [int(v) for v in y],
                # The archive's layout: rows of 1024 red, then green, then blue values.
                b"data": x.transpose(0, 3, 1, 2).reshape(len(y), 3072),
                b"filenames": [f"{name}_{i}.png".encode() for i in range(len(y))],
            }
            with (path / name).open("wb") as fh:
                pickle.dump(batch, fh, protocol=2)

        for b in range(5):
            sl = slice(b * per_batch, (b + 1) * per_batch)
            dump(f"data_batch_{b + 1}", train_x[sl], train_y[sl])
        dump("test_batch", test_x, test_y)
        with (path / "batches.meta").open("wb") as fh:
            meta = {b"label_names": [c.encode() for c in CIFAR_CLASSES], b"num_vis": 3072}
            pickle.dump(meta, fh, protocol=2)
        return path
    datasets = _quiet_datasets()
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=CIFAR_CLASSES)}
    )

    def split(x: np.ndarray, y: np.ndarray) -> datasets.Dataset:
        return datasets.Dataset.from_dict({"img": list(x), "label": y.tolist()}, features=features)

    dd = datasets.DatasetDict({"train": split(train_x, train_y), "test": split(test_x, test_y)})
    if fmt == "disk":
        path = root / "cifar10"
        dd.save_to_disk(str(path))
        return path
    if fmt == "parquet":
        path = root / "cifar10_parquet"
        (path / "plain_text").mkdir(parents=True, exist_ok=True)
        for name, ds in dd.items():
            ds.to_parquet(str(path / "plain_text" / f"{name}-00000-of-00001.parquet"))
        return path
    raise ValueError(f"fmt={fmt!r}: allowed: pickle, disk, parquet")


IDX_UBYTE = 0x08


def idx_bytes(array: np.ndarray, type_code: int = IDX_UBYTE) -> bytes:
    """An IDX file's bytes: magic ``(type_code << 8) | ndim``, big-endian int32 dims,
    then the values (uint8, C order)."""
    header = ((type_code << 8) | array.ndim).to_bytes(4, "big")
    dims = np.asarray(array.shape, dtype=">i4").tobytes()
    return header + dims + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def fashion_arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (n, 28, 28), labels uint8) with every class present when n >= 10.

    Class c is a bright 9x6 block at its own place of a 3x4 grid on a dark, noisy
    background: a small CNN learns that in a few steps (per-pixel random patterns, as
    for the other fixtures, keep it on its initial loss plateau for many more).
    """
    labels = np.random.default_rng(seed).permutation(np.arange(n) % 10)
    rng = np.random.default_rng(seed + 100)
    images = rng.normal(0.1, 0.1, (n, 28, 28))
    for c in range(10):
        row, col = divmod(c, 4)
        images[labels == c, 1 + 9 * row : 10 + 9 * row, 1 + 6 * col : 7 + 6 * col] += 0.7
    return np.clip(images * 255, 0, 255).astype(np.uint8), labels.astype(np.uint8)


def write_fashion_mnist(root: Path, fmt: str = "gz", train: int = 600, test: int = 100) -> Path:
    """Write a Fashion-MNIST copy (``train`` and ``test`` images) under ``root``; return
    the path to give ``dataset.path``.

    ``fmt``: "gz" (the four ``*-ubyte.gz`` files, as the Debian package installs them),
    "raw" (uncompressed) or "torchvision" (``FashionMNIST/raw`` holding both, as
    ``torchvision.datasets.FashionMNIST(root, download=True)`` leaves it; returns root).
    """
    if fmt not in ("gz", "raw", "torchvision"):
        raise ValueError(f"fmt={fmt!r}: allowed: gz, raw, torchvision")
    path = root / f"fashion_mnist_{fmt}"
    target = path / "FashionMNIST" / "raw" if fmt == "torchvision" else path
    target.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", train, 3), ("t10k", test, 4)):
        images, labels = fashion_arrays(n, seed)
        for name, array in (
            (f"{split}-images-idx3-ubyte", images),
            (f"{split}-labels-idx1-ubyte", labels),
        ):
            data = idx_bytes(array)
            if fmt != "gz":
                (target / name).write_bytes(data)
            if fmt != "raw":
                # mtime=0: the same bytes on every run
                (target / f"{name}.gz").write_bytes(gzip.compress(data, mtime=0))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="directory to write femnist/ and cifar10/ into")
    args = parser.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    print(f"femnist: dataset.path={write_femnist(args.root)}")
    print(f"cifar10: dataset.path={write_cifar10(args.root, fmt='disk')}")
    print(f"fashion_mnist: dataset.path={write_fashion_mnist(args.root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
