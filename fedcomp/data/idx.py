"""Fashion-MNIST from IDX files (the format of the original MNIST distribution).

An IDX file is a 4-byte magic number (two zero bytes, a type code, the number of
dimensions), one big-endian int32 per dimension, then the values in C order. Labels
are ``0x00000801`` (unsigned bytes, one dimension), images ``0x00000803`` (unsigned
bytes, three dimensions: count, rows, columns). Files may be gzipped.

The parser is plain numpy (nothing is unpickled) and checks everything: a truncated
or corrupt file, a wrong magic or type code, dimensions that do not match the bytes,
images that are not 28x28, label values outside 0..9 and image and label files of
different lengths each raise a :class:`DataError` naming the file and the problem.

Where the files are looked for (``dataset.path``, default the Debian package's
directory ``/usr/share/datasets/fashion-mnist``): the directory itself, its ``raw``
subdirectory and its ``FashionMNIST/raw`` subdirectory (torchvision's layout, where
``root`` is what ``torchvision.datasets.FashionMNIST(root)`` was given). Each of the
four files may be gzipped (``.gz``) or not; an uncompressed copy is preferred.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import numpy as np

from fedcomp.data.sources import CATALOG, DataError, RawData

#: Where the Debian package ``dataset-fashion-mnist`` installs the four files.
DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"

#: The four files of the distribution, by split: (images, labels).
FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

#: Subdirectories of ``dataset.path`` searched, in this order.
LAYOUTS = ("", "raw", "FashionMNIST/raw")

#: IDX type code of unsigned bytes (the only one the distribution uses).
UBYTE = 0x08

#: How to get the data (quoted in the errors and in docs/experiments.md).
GET_FASHION_MNIST = (
    "sudo apt-get install dataset-fashion-mnist (Debian/Ubuntu; `make data` runs it as "
    "root, or prints it), or point dataset.path at a directory holding the four IDX files "
    "(e.g. torchvision's FashionMNIST/raw)"
)


def _read_bytes(path: Path) -> bytes:
    """The file's content, gunzipped when its name ends in ``.gz``."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rb") as fh:
                return fh.read()
        return path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile is an OSError
        raise DataError(
            f"dataset 'fashion_mnist': {str(path)!r} cannot be read "
            f"({type(exc).__name__}: {exc}); the file is truncated or corrupt: "
            f"re-install it ({GET_FASHION_MNIST})"
        ) from exc


def parse_idx(data: bytes, ndim: int, where: str) -> np.ndarray:
    """The uint8 array of an IDX file's bytes, checked against its header.

    Parameters
    ----------
    data : bytes
        The whole (decompressed) file.
    ndim : int
        The expected number of dimensions (1 for labels, 3 for images).
    where : str
        The file's name, for the error messages.

    Raises
    ------
    DataError
        When the header is short, the magic number or type code is not the expected
        one, or the dimensions do not match the number of bytes that follow.
    """
    expected_magic = (UBYTE << 8) | ndim
    if len(data) < 4:
        raise DataError(
            f"dataset 'fashion_mnist': {where} holds {len(data)} bytes, fewer than an IDX "
            f"magic number (4 bytes): the file is truncated"
        )
    magic = int.from_bytes(data[:4], "big")
    if magic >> 16 != 0 or (magic & 0xFF) != ndim:
        raise DataError(
            f"dataset 'fashion_mnist': {where} starts with magic number 0x{magic:08x}, "
            f"expected 0x{expected_magic:08x} (an IDX file with {ndim} dimension(s)): "
            f"it is not the expected file or it is corrupt"
        )
    if (magic >> 8) & 0xFF != UBYTE:
        raise DataError(
            f"dataset 'fashion_mnist': {where} has IDX type code 0x{(magic >> 8) & 0xFF:02x}, "
            f"expected 0x{UBYTE:02x} (unsigned bytes): it is not a Fashion-MNIST file"
        )
    if len(data) < 4 + 4 * ndim:
        raise DataError(
            f"dataset 'fashion_mnist': {where} holds {len(data)} bytes, fewer than an IDX "
            f"header with {ndim} dimension(s) ({4 + 4 * ndim} bytes): the file is truncated"
        )
    dims = tuple(int(d) for d in np.frombuffer(data, dtype=">i4", count=ndim, offset=4))
    body = len(data) - 4 - 4 * ndim
    if any(d < 0 for d in dims) or int(np.prod(dims, dtype=np.int64)) != body:
        raise DataError(
            f"dataset 'fashion_mnist': {where} declares dimensions {dims} "
            f"({int(np.prod(dims, dtype=np.int64))} values) but holds {body} bytes of data: "
            f"the file is truncated or corrupt"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def find_idx_dir(path: str) -> Path:
    """The directory holding the four files: ``path``, ``path/raw`` or
    ``path/FashionMNIST/raw`` ("" = :data:`DEFAULT_DIR`).

    Raises
    ------
    DataError
        When none holds all four files (naming what is missing and how to get them).
    """
    root = Path(os.path.expanduser(path or DEFAULT_DIR))
    names = [n for pair in FILES.values() for n in pair]
    for sub in LAYOUTS:
        candidate = root / sub if sub else root
        if all(_file_of(candidate, n) is not None for n in names):
            return candidate
    if root.is_dir():
        missing = [n for n in names if _file_of(root, n) is None]
        problem = f"{str(root)!r} lacks {', '.join(missing)} (as is or .gz)"
    else:
        problem = f"no directory {str(root)!r}"
    raise DataError(
        f"dataset 'fashion_mnist': {problem}; looked in it, in raw/ and in "
        f"FashionMNIST/raw/. Get the data: {GET_FASHION_MNIST}"
    )


def _file_of(directory: Path, name: str) -> Path | None:
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def read_split(directory: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (n, 28, 28), labels int64 (n,)) of one split, checked.

    Raises
    ------
    DataError
        For a corrupt file, images other than 28x28, labels outside 0..9, or image
        and label files of different lengths (naming the files).
    """
    image_name, label_name = FILES[split]
    image_path, label_path = _file_of(directory, image_name), _file_of(directory, label_name)
    if image_path is None or label_path is None:
        raise DataError(f"dataset 'fashion_mnist': {str(directory)!r} lacks the {split} files")
    images = parse_idx(_read_bytes(image_path), 3, repr(str(image_path)))
    labels = parse_idx(_read_bytes(label_path), 1, repr(str(label_path)))
    _check_split(images, labels, image_path, label_path)
    return images, labels.astype(np.int64)


def _check_split(
    images: np.ndarray, labels: np.ndarray, image_path: Path, label_path: Path
) -> None:
    _, height, width = CATALOG["fashion_mnist"].shape
    if images.shape[1:] != (height, width):
        raise DataError(
            f"dataset 'fashion_mnist': {str(image_path)!r} holds {images.shape[1]}x"
            f"{images.shape[2]} images, expected {height}x{width}"
        )
    if images.shape[0] != labels.shape[0]:
        raise DataError(
            f"dataset 'fashion_mnist': {str(image_path)!r} holds {images.shape[0]} images "
            f"but {str(label_path)!r} holds {labels.shape[0]} labels: the files do not "
            f"belong together"
        )
    if labels.size == 0:
        raise DataError(f"dataset 'fashion_mnist': {str(label_path)!r} holds no labels")
    num_classes = CATALOG["fashion_mnist"].num_classes
    if int(labels.max()) >= num_classes:
        raise DataError(
            f"dataset 'fashion_mnist': {str(label_path)!r} holds label {int(labels.max())}, "
            f"expected 0..{num_classes - 1}"
        )


def load_fashion_mnist_raw(path: str) -> RawData:
    """The 60,000 training and 10,000 test images (rows: training first), pixels
    scaled to [0, 1] as the NIID-Bench baseline does (no mean/std normalization).

    Raises
    ------
    DataError
        When the files are missing, corrupt or do not belong together.
    """
    spec = CATALOG["fashion_mnist"]
    directory = find_idx_dir(path)
    train_x, train_y = read_split(directory, "train")
    test_x, test_y = read_split(directory, "test")
    images = np.concatenate([train_x, test_x])[:, None, :, :]
    labels = np.concatenate([train_y, test_y])
    test_mask = np.zeros(labels.size, dtype=bool)
    test_mask[train_y.size :] = True
    mean, std = np.float32(spec.mean[0]), np.float32(spec.std[0])

    def decode(rows: np.ndarray) -> np.ndarray:
        pixels = images[np.asarray(rows, dtype=np.int64)].astype(np.float32) / np.float32(255)
        return (pixels - mean) / std

    return RawData(spec, labels, None, test_mask, decode, repr(str(directory)))
