"""Where each dataset's rows come from: the bundled digits, the generated synthetic task,
and FEMNIST / CIFAR-10 from a local copy or the Hugging Face hub (through flwr-datasets).

A loader returns a :class:`RawData`: the labels (and writer ids) of every row, which
rows the copy marks as its test split, and a function that decodes the features of
chosen rows only. Partitioning needs the labels alone, so a client decodes the images
of its own partition and nothing else (FEMNIST has 814,277 images).

Local copies, by format (``dataset.path``):

- a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset`` or a
  ``DatasetDict`` with ``train`` and, for CIFAR-10, ``test``);
- parquet: one ``.parquet`` file, or a directory holding them (the hub's own layout,
  e.g. ``plain_text/train-00000-of-00001.parquet``); a file whose name contains
  ``test`` belongs to the test split, every other file to the training split;
- CIFAR-10 only: torchvision's ``cifar-10-batches-py`` directory (or its parent),
  the python pickles ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``, read
  by an unpickler that refuses every global but numpy's array reconstruction (a
  planted file cannot run code).
"""

from __future__ import annotations

import codecs
import io
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedcomp.rng import numpy_generator


class DataError(ValueError):
    """A dataset that cannot be loaded: the message names the path and the fix."""


@dataclass(frozen=True)
class DatasetSpec:
    """What the code knows about a dataset before loading it."""

    name: str
    #: Model input shape: (features,) or (channels, height, width).
    shape: tuple[int, ...]
    num_classes: int
    hub_id: str = ""
    image_column: str = ""
    label_column: str = ""
    group_column: str = ""
    #: Per-channel normalization after scaling pixels to [0, 1].
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    #: True when the copy's own test split is the server's test set.
    has_test_split: bool = False

    @property
    def is_image(self) -> bool:
        return len(self.shape) == 3


CATALOG: dict[str, DatasetSpec] = {
    "digits": DatasetSpec("digits", (64,), 10),
    "synthetic": DatasetSpec("synthetic", (64,), 10),
    "femnist": DatasetSpec(
        "femnist",
        (1, 28, 28),
        62,
        hub_id="flwrlabs/femnist",
        image_column="image",
        label_column="character",
        group_column="writer_id",
        mean=(0.0,),
        std=(1.0,),
    ),
    "cifar10": DatasetSpec(
        "cifar10",
        (3, 32, 32),
        10,
        hub_id="uoft-cs/cifar10",
        image_column="img",
        label_column="label",
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
        has_test_split=True,
    ),
    # IDX files on disk (fedcomp.data.idx); pixels in [0, 1] as in NIID-Bench.
    "fashion_mnist": DatasetSpec(
        "fashion_mnist", (1, 28, 28), 10, mean=(0.0,), std=(1.0,), has_test_split=True
    ),
}

#: How to put each hub dataset on disk (quoted in the errors and in docs/experiments.md).
GET_DATA = {
    "femnist": (
        'python -c "from datasets import load_dataset; '
        "load_dataset('flwrlabs/femnist', split='train').save_to_disk('data/femnist')\""
    ),
    "cifar10": (
        'python -c "from datasets import load_dataset; '
        "load_dataset('uoft-cs/cifar10').save_to_disk('data/cifar10')\"  "
        '(or torchvision: python -c "import torchvision; '
        "torchvision.datasets.CIFAR10('data', download=True)\" and "
        "dataset.path=data/cifar-10-batches-py)"
    ),
}


def spec_of(name: str) -> DatasetSpec:
    """The catalog entry of ``name`` (a ValueError naming the allowed names otherwise)."""
    if name not in CATALOG:
        raise ValueError(f"invalid setting dataset.name={name!r}: allowed: {', '.join(CATALOG)}")
    return CATALOG[name]


@dataclass(frozen=True)
class RawData:
    """Every row of a dataset: labels, writer ids, the copy's test rows, a decoder.

    ``decode(rows)`` returns the features of ``rows`` (sorted or not) as float32,
    normalized, shaped ``(len(rows), *spec.shape)``.
    """

    spec: DatasetSpec
    labels: np.ndarray
    groups: np.ndarray | None
    test_mask: np.ndarray | None
    decode: Callable[[np.ndarray], np.ndarray]
    origin: str

    def __len__(self) -> int:
        return int(self.labels.shape[0])


# ---------------------------------------------------------------------------------
# in-memory datasets: digits and synthetic
# ---------------------------------------------------------------------------------


def _from_arrays(spec: DatasetSpec, x: np.ndarray, y: np.ndarray, origin: str) -> RawData:
    def decode(rows: np.ndarray) -> np.ndarray:
        return x[np.asarray(rows, dtype=np.int64)]

    return RawData(spec, y, None, None, decode, origin)


def load_digits_raw() -> RawData:
    """scikit-learn's bundled 8x8 digits, pixels scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32)
    return _from_arrays(CATALOG["digits"], x, bunch.target.astype(np.int64), "scikit-learn")


#: The synthetic task does not depend on the run seed: every seed and every method
#: sees the same samples (paired comparisons), as with the other datasets.
SYNTHETIC_SEED = 0


def synthetic_arrays(num_samples: int, tail_df: float) -> tuple[np.ndarray, np.ndarray]:
    """A linear 10-class task with heavy-tailed features.

    Features are i.i.d. Student-t with ``tail_df`` degrees of freedom (64 of them); the
    label is the argmax of a fixed Gaussian linear teacher. The loss gradient of a
    sample is ``(softmax - onehot) x^T``, so client updates inherit the features' tails:
    moments of order >= ``tail_df`` are infinite. Everything is drawn from generators
    derived from (SYNTHETIC_SEED, num_samples, tail_df).
    """
    d, k = CATALOG["synthetic"].shape[0], CATALOG["synthetic"].num_classes
    rng = numpy_generator(SYNTHETIC_SEED, "synthetic", num_samples, repr(float(tail_df)))
    teacher = rng.standard_normal((d, k))
    x = rng.standard_t(tail_df, size=(num_samples, d)).astype(np.float32)
    y = np.argmax(x.astype(np.float64) @ teacher, axis=1).astype(np.int64)
    return x, y


def load_synthetic_raw(num_samples: int, tail_df: float) -> RawData:
    x, y = synthetic_arrays(num_samples, tail_df)
    origin = f"synthetic (num_samples={num_samples}, tail_df={tail_df})"
    return _from_arrays(CATALOG["synthetic"], x, y, origin)


# ---------------------------------------------------------------------------------
# image tables (arrow: save_to_disk, parquet, the hub) and CIFAR pickles
# ---------------------------------------------------------------------------------


def _missing_data_error(spec: DatasetSpec, path: str, problem: str) -> DataError:
    return DataError(
        f"dataset '{spec.name}': {problem}. Get the data on a machine with internet "
        f"access and point dataset.path at it: {GET_DATA[spec.name]}"
        + (f" (dataset.path={path!r})" if path else "")
    )


def _image_decoder(spec: DatasetSpec, where: str) -> Callable[[Sequence[dict]], np.ndarray]:
    """Decode datasets' Image cells ({"bytes", "path"}) into uint8 (n, C, H, W)."""
    from PIL import Image, UnidentifiedImageError

    channels, height, width = spec.shape
    mode = "L" if channels == 1 else "RGB"

    def decode(cells: Sequence[dict]) -> np.ndarray:
        out = np.empty((len(cells), height, width, channels), dtype=np.uint8)
        for i, cell in enumerate(cells):
            data = cell.get("bytes") if isinstance(cell, dict) else None
            try:
                if data is not None:
                    img = Image.open(io.BytesIO(data))
                elif isinstance(cell, dict) and cell.get("path"):
                    img = Image.open(cell["path"])
                else:
                    raise DataError(f"{where}: an image cell holds neither bytes nor a path")
                arr = np.asarray(img.convert(mode)).reshape(img.height, img.width, channels)
            except (OSError, UnidentifiedImageError) as exc:
                raise DataError(
                    f"{where}: an image could not be decoded ({exc}); the copy is "
                    f"corrupt: re-create it ({GET_DATA[spec.name]})"
                ) from exc
            if arr.shape != (height, width, channels):
                raise DataError(
                    f"{where}: found {arr.shape[1]}x{arr.shape[0]}x{channels} images, but "
                    f"the models for '{spec.name}' take {width}x{height}x{channels} "
                    f"(channels x {height} x {width}); resize the copy or use the "
                    f"original {spec.hub_id}"
                )
            out[i] = arr
        return out.transpose(0, 3, 1, 2)

    return decode


def _normalizer(spec: DatasetSpec) -> Callable[[np.ndarray], np.ndarray]:
    mean = np.asarray(spec.mean, dtype=np.float32).reshape(1, -1, 1, 1)
    std = np.asarray(spec.std, dtype=np.float32).reshape(1, -1, 1, 1)

    def normalize(images: np.ndarray) -> np.ndarray:
        return ((images.astype(np.float32) / 255.0 - mean) / std).astype(np.float32)

    return normalize


@dataclass(frozen=True)
class _Part:
    """One split of a copy: labels, writer ids, and a uint8 image reader by row."""

    labels: np.ndarray
    groups: np.ndarray | None
    read: Callable[[np.ndarray], np.ndarray]


def _column_names(table) -> list[str]:
    return list(table.column_names)


def _arrow_part(spec: DatasetSpec, table, where: str) -> _Part:
    """A split held in a pyarrow Table with datasets' column layout."""
    import pyarrow as pa

    needed = [spec.image_column, spec.label_column] + (
        [spec.group_column] if spec.group_column else []
    )
    missing = [c for c in needed if c not in _column_names(table)]
    if missing:
        raise DataError(
            f"{where}: missing column(s) {', '.join(missing)} (found "
            f"{', '.join(_column_names(table))}); a copy of {spec.hub_id} has "
            f"{', '.join(needed)}: re-create it ({GET_DATA[spec.name]})"
        )
    labels = np.asarray(table.column(spec.label_column).to_numpy(), dtype=np.int64)
    groups = (
        np.asarray(table.column(spec.group_column).to_pylist(), dtype=object).astype(str)
        if spec.group_column
        else None
    )
    images = table.column(spec.image_column)
    decode = _image_decoder(spec, where)

    def read(rows: np.ndarray) -> np.ndarray:
        cells = images.take(pa.array(np.asarray(rows, dtype=np.int64))).to_pylist()
        return decode(cells)

    return _Part(labels, groups, read)


def _check_part(spec: DatasetSpec, part: _Part, where: str) -> None:
    """Labels in range, and the first image of the right size (fail before training)."""
    if part.labels.size == 0:
        raise DataError(f"{where}: the split is empty; the copy is partial: re-create it")
    low, high = int(part.labels.min()), int(part.labels.max())
    if low < 0 or high >= spec.num_classes:
        raise DataError(
            f"{where}: labels span {low}..{high}, but '{spec.name}' has {spec.num_classes} "
            f"classes (0..{spec.num_classes - 1}): this is not a copy of {spec.hub_id}"
        )
    part.read(np.array([0]))


def _read_save_to_disk(spec: DatasetSpec, path: Path) -> dict[str, object]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError, pyarrow errors, ...
        raise DataError(
            f"dataset '{spec.name}': the local copy at {str(path)!r} is not a readable "
            f"datasets save_to_disk directory ({type(exc).__name__}: {exc}); it is partial "
            f"or corrupt: re-create it: {GET_DATA[spec.name]}"
        ) from exc
    splits = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
    # save_to_disk writes flattened rows (no indices mapping), so .data is the rows.
    return {name: ds.data.table for name, ds in splits.items()}


def _parquet_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path] if path.suffix == ".parquet" else []
    return sorted(path.rglob("*.parquet"))


def _read_parquet(spec: DatasetSpec, files: list[Path], path: Path) -> dict[str, object]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    by_split: dict[str, list] = {}
    for f in files:
        split = "test" if "test" in f.name else "train"
        try:
            by_split.setdefault(split, []).append(pq.read_table(f))
        except Exception as exc:
            raise DataError(
                f"dataset '{spec.name}': the parquet file {str(f)!r} under {str(path)!r} "
                f"cannot be read ({type(exc).__name__}: {exc}); it is partial or corrupt: "
                f"re-create the copy: {GET_DATA[spec.name]}"
            ) from exc
    try:
        return {s: pa.concat_tables(t) for s, t in by_split.items()}
    except pa.ArrowInvalid as exc:
        raise DataError(
            f"dataset '{spec.name}': the parquet files under {str(path)!r} do not share one "
            f"schema ({exc})"
        ) from exc


CIFAR_BATCHES = ("data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5")


def _cifar_batches_dir(path: Path) -> Path | None:
    if path.is_dir() and (path / "cifar-10-batches-py").is_dir():
        return path / "cifar-10-batches-py"
    if path.is_dir() and any((path / n).exists() for n in (*CIFAR_BATCHES, "test_batch")):
        return path
    return None


def _latin1(text: str, encoding: str) -> bytes:
    """``_codecs.encode`` as protocol-2 pickles of bytes use it, and nothing else."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError(f"refuses _codecs.encode(..., {encoding!r})")
    return codecs.encode(text, "latin1")


#: The only globals a CIFAR-10 python batch names: numpy's array reconstruction (the
#: archive was written by numpy 1 as ``numpy.core``, numpy 2 writes ``numpy._core``)
#: and, in batches written by Python 3 with protocol 2, ``_codecs.encode`` for bytes.
_CIFAR_GLOBALS: dict[tuple[str, str], object] = {
    ("numpy.core.multiarray", "_reconstruct"): np.ndarray((0,)).__reduce__()[0],
    ("numpy._core.multiarray", "_reconstruct"): np.ndarray((0,)).__reduce__()[0],
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1,
}


class _CifarUnpickler(pickle.Unpickler):
    """Loads a CIFAR-10 batch (dicts, lists, bytes, ints, numpy arrays) and refuses any
    other global, so a planted file cannot run code (a plain pickle.load would)."""

    def find_class(self, module: str, name: str) -> object:
        found = _CIFAR_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(
                f"refused the global {module}.{name}: a CIFAR-10 batch holds only dicts, "
                "lists, bytes, numbers and numpy arrays"
            )
        return found


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        with path.open("rb") as fh:
            # The official archive's format, through an unpickler that builds only it.
            batch = _CifarUnpickler(fh, encoding="bytes").load()
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except Exception as exc:
        raise DataError(
            f"dataset 'cifar10': {str(path)!r} is not a readable CIFAR-10 python batch "
            f"({type(exc).__name__}: {exc}); the copy is partial or corrupt: re-download "
            f"it: {GET_DATA['cifar10']}"
        ) from exc
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != labels.size:
        raise DataError(
            f"dataset 'cifar10': {str(path)!r} holds data of shape {data.shape} with "
            f"{labels.size} labels; a CIFAR-10 batch holds n x 3072 uint8 (3x32x32 images): "
            f"re-download it: {GET_DATA['cifar10']}"
        )
    return data.reshape(-1, 3, 32, 32), labels


def _read_cifar_pickles(directory: Path) -> dict[str, _Part]:
    names = (*CIFAR_BATCHES, "test_batch")
    missing = [n for n in names if not (directory / n).is_file()]
    if missing:
        raise DataError(
            f"dataset 'cifar10': the copy at {str(directory)!r} is partial: missing "
            f"{', '.join(missing)}; re-download it: {GET_DATA['cifar10']}"
        )
    train = [_read_cifar_batch(directory / n) for n in CIFAR_BATCHES]
    test_x, test_y = _read_cifar_batch(directory / "test_batch")
    train_x = np.concatenate([x for x, _ in train])
    train_y = np.concatenate([y for _, y in train])

    def reader(images: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        return lambda rows: images[np.asarray(rows, dtype=np.int64)]

    return {
        "train": _Part(train_y, None, reader(train_x)),
        "test": _Part(test_y, None, reader(test_x)),
    }


def _hub_tables(spec: DatasetSpec) -> dict[str, object]:
    """Both splits from the hub through flwr-datasets (cached by datasets afterwards)."""
    from flwr_datasets import FederatedDataset

    splits = ("train", "test") if spec.has_test_split else ("train",)
    try:
        fds = FederatedDataset(
            dataset=spec.hub_id, partitioners={"train": 1}, shuffle=False, seed=None
        )
        return {s: fds.load_split(s).data.table for s in splits}
    except Exception as exc:  # offline, no cache, hub errors
        raise _missing_data_error(
            spec,
            "",
            f"dataset.path is empty and the hub dataset {spec.hub_id} is not reachable "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})",
        ) from exc


def _combine(spec: DatasetSpec, parts: dict[str, _Part], origin: str) -> RawData:
    """One row space over the splits: training rows first, then test rows."""
    if spec.has_test_split and "test" not in parts:
        raise DataError(
            f"dataset '{spec.name}': the copy at {origin} has no test split (found "
            f"{', '.join(parts)}); it is partial: re-create it with both splits: "
            f"{GET_DATA[spec.name]}"
        )
    if "train" not in parts:
        raise DataError(
            f"dataset '{spec.name}': the copy at {origin} has no training split (found "
            f"{', '.join(parts)}): re-create it: {GET_DATA[spec.name]}"
        )
    order = ["train", "test"] if spec.has_test_split else ["train"]
    used = [parts[s] for s in order]
    sizes = [p.labels.size for p in used]
    offsets = np.cumsum([0, *sizes])
    labels = np.concatenate([p.labels for p in used])
    groups = None if spec.group_column == "" else np.concatenate([p.groups for p in used])
    test_mask = None
    if spec.has_test_split:
        test_mask = np.zeros(labels.size, dtype=bool)
        test_mask[offsets[1] :] = True
    normalize = _normalizer(spec)

    def decode(rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((rows.size, *spec.shape), dtype=np.uint8)
        which = np.searchsorted(offsets, rows, side="right") - 1
        for k, part in enumerate(used):
            sel = np.flatnonzero(which == k)
            if sel.size:
                out[sel] = part.read(rows[sel] - offsets[k])
        return normalize(out)

    return RawData(spec, labels, groups, test_mask, decode, origin)


def load_image_raw(name: str, path: str) -> RawData:
    """FEMNIST or CIFAR-10 from ``path`` (a local copy) or, when ``path`` is "", the hub.

    Raises
    ------
    DataError
        When the path is missing, the copy is partial or corrupt, has other columns,
        or holds images of another size; the message names the path and the fix.
    """
    spec = spec_of(name)
    if not path:
        tables = _hub_tables(spec)
        origin = f"hub:{spec.hub_id}"
        parts = {s: _arrow_part(spec, t, f"{origin} ({s})") for s, t in tables.items()}
        return _checked(spec, parts, origin)
    where = Path(os.path.expanduser(path))
    if not where.exists():
        raise _missing_data_error(spec, path, f"no local copy at {str(where)!r}")
    origin = repr(str(where))
    if spec.name == "cifar10" and (batches := _cifar_batches_dir(where)) is not None:
        return _checked(spec, _read_cifar_pickles(batches), repr(str(batches)))
    if where.is_dir() and any(
        (where / f).is_file() for f in ("dataset_info.json", "dataset_dict.json", "state.json")
    ):
        tables = _read_save_to_disk(spec, where)
    elif files := _parquet_files(where):
        tables = _read_parquet(spec, files, where)
    else:
        found = sorted(p.name for p in where.iterdir())[:8] if where.is_dir() else [where.name]
        kinds = "a datasets save_to_disk directory or parquet file(s)" + (
            " or torchvision's cifar-10-batches-py" if spec.name == "cifar10" else ""
        )
        raise DataError(
            f"dataset '{spec.name}': {origin} is not {kinds} (found: "
            f"{', '.join(found) or 'an empty directory'}); create a copy with: "
            f"{GET_DATA[spec.name]}"
        )
    parts = {s: _arrow_part(spec, t, f"{origin} ({s})") for s, t in tables.items()}
    return _checked(spec, parts, origin)


def _checked(spec: DatasetSpec, parts: dict[str, _Part], origin: str) -> RawData:
    for split, part in parts.items():
        _check_part(spec, part, f"dataset '{spec.name}' at {origin} ({split})")
    return _combine(spec, parts, origin)
