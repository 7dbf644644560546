"""Loading, splitting and partitioning: the data side of one federated task.

The server's test split never depends on the run seed, so every seed and every method
is evaluated on the same samples (paired comparisons):

- digits, synthetic: a label-stratified ``dataset.test_fraction`` of the samples;
- cifar10, fashion_mnist: the official test split (``test_fraction`` is not used);
- femnist: ``num_clients`` writers are drawn once from a fixed permutation of the
  writers with enough samples (so 8 clients are a subset of 16), and
  ``test_fraction`` of each chosen writer's samples is held out (as LEAF does).

The training rows are divided among clients by a flwr-datasets partitioner
(``DirichletPartitioner``, ``IidPartitioner``, ``NaturalIdPartitioner`` by writer,
``PathologicalPartitioner``) run on a local ``datasets.Dataset`` of row ids and labels,
or by NIID-Bench's own rules (``niid_labeldir``, ``niid_labels``: fedcomp.data.niid);
each client holds out ``partition.val_fraction`` of its partition for client-side
evaluation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from fedcomp.data.idx import load_fashion_mnist_raw
from fedcomp.data.niid import NIID_PARTITIONS, niid_partition
from fedcomp.data.sources import (
    RawData,
    load_digits_raw,
    load_image_raw,
    load_synthetic_raw,
    spec_of,
)
from fedcomp.rng import derive_seed, numpy_generator
from fedcomp.settings import DatasetSettings, PartitionSettings, Settings

#: The test split does not depend on the run seed, so every seed and every method is
#: evaluated on the same images (paired comparisons).
TEST_SPLIT_SEED = 0


@dataclass(frozen=True)
class ArrayDataset:
    """Features and labels as torch tensors (float32 features, int64 labels)."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])


def _dataset_key(dataset: DatasetSettings) -> tuple:
    """The settings that change the rows (others do not reload the data)."""
    if dataset.name == "synthetic":
        return (dataset.name, dataset.num_samples, float(dataset.tail_df))
    if spec_of(dataset.name).hub_id or dataset.name == "fashion_mnist":
        return (dataset.name, dataset.path)
    return (dataset.name,)


@functools.lru_cache(maxsize=4)
def _raw(key: tuple) -> RawData:
    name = key[0]
    if name == "digits":
        return load_digits_raw()
    if name == "synthetic":
        return load_synthetic_raw(key[1], key[2])
    if name == "fashion_mnist":
        return load_fashion_mnist_raw(key[1])
    return load_image_raw(name, key[1])


def load_raw(dataset: DatasetSettings) -> RawData:
    """Every row of the configured dataset (cached per process).

    Raises
    ------
    DataError
        When a local copy is missing, partial or corrupt (naming the path and the fix).
    """
    spec_of(dataset.name)  # an unknown name fails with the allowed names
    return _raw(_dataset_key(dataset))


def load_arrays(name: str) -> tuple[np.ndarray, np.ndarray]:
    """All features (float32) and labels (int64) of an in-memory dataset with default
    settings (digits, synthetic); image datasets decode rows on demand (:func:`load_raw`)."""
    raw = load_raw(DatasetSettings(name=name))
    if spec_of(name).is_image:
        raise ValueError(f"load_arrays: dataset '{name}' is decoded on demand; use load_raw")
    return raw.decode(np.arange(len(raw))), raw.labels


# ---------------------------------------------------------------------------------
# the server's test split
# ---------------------------------------------------------------------------------


def _stratified_split(
    labels: np.ndarray, name: str, test_fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    rng = numpy_generator(TEST_SPLIT_SEED, "test-split", name)
    test, train = [], []
    for label in np.unique(labels):
        idx = np.flatnonzero(labels == label)
        rng.shuffle(idx)
        n_test = round(test_fraction * idx.size)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(test)), np.sort(np.concatenate(train))


def writer_rows(groups: np.ndarray) -> dict[str, np.ndarray]:
    """Row ids of every writer (sorted rows, writers in sorted order)."""
    order = np.argsort(groups, kind="stable")
    writers, starts = np.unique(groups[order], return_index=True)
    bounds = [*starts[1:], order.size]
    return {str(w): np.sort(order[s:e]) for w, s, e in zip(writers, starts, bounds, strict=True)}


def _held_out(n: int, test_fraction: float) -> int:
    return round(test_fraction * n)


def choose_writers(
    groups: np.ndarray, name: str, num_clients: int, test_fraction: float, min_size: int
) -> list[str]:
    """The first ``num_clients`` of a fixed permutation of the eligible writers (those
    whose training part, after the test hold-out, has at least ``min_size`` samples).

    Raises
    ------
    ValueError
        When fewer writers are eligible than clients are asked for.
    """
    rows = writer_rows(groups)
    eligible = sorted(
        w for w, r in rows.items() if r.size - _held_out(r.size, test_fraction) >= min_size
    )
    if num_clients > len(eligible):
        raise ValueError(
            f"invalid setting num_clients={num_clients}: dataset '{name}' has {len(rows)} "
            f"writers, {len(eligible)} of them with at least partition.min_partition_size="
            f"{min_size} training samples after the test hold-out (dataset.test_fraction="
            f"{test_fraction}); the natural partition gives each client one writer: use at "
            f"most {len(eligible)} clients or a smaller partition.min_partition_size"
        )
    perm = numpy_generator(TEST_SPLIT_SEED, "writers", name).permutation(len(eligible))
    return sorted(eligible[i] for i in perm[:num_clients])


def _split_key(settings: Settings) -> tuple:
    d = settings.dataset
    if spec_of(d.name).group_column:
        return (
            _dataset_key(d),
            d.test_fraction,
            settings.num_clients,
            settings.partition.min_partition_size,
        )
    return (_dataset_key(d), d.test_fraction)


@functools.lru_cache(maxsize=16)
def _split(key: tuple) -> tuple[np.ndarray, np.ndarray]:
    dataset_key, test_fraction = key[0], key[1]
    raw = _raw(dataset_key)
    name = raw.spec.name
    if raw.test_mask is not None:
        return np.flatnonzero(raw.test_mask), np.flatnonzero(~raw.test_mask)
    if raw.groups is None:
        return _stratified_split(raw.labels, name, test_fraction)
    num_clients, min_size = key[2], key[3]
    chosen = choose_writers(raw.groups, name, num_clients, test_fraction, min_size)
    rows = writer_rows(raw.groups)
    test, train = [], []
    for writer in chosen:
        idx = rows[writer].copy()
        numpy_generator(TEST_SPLIT_SEED, "test-split", name, writer).shuffle(idx)
        n_test = _held_out(idx.size, test_fraction)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(test)), np.sort(np.concatenate(train))


def split_rows(settings: Settings) -> tuple[np.ndarray, np.ndarray]:
    """(server test rows, training rows) of the configured task."""
    load_raw(settings.dataset)
    return _split(_split_key(settings))


def server_test_set(settings: Settings) -> ArrayDataset:
    """The server's held-out test split (centralized evaluation)."""
    raw = load_raw(settings.dataset)
    test_rows, _ = split_rows(settings)
    return ArrayDataset(
        torch.from_numpy(raw.decode(test_rows)), torch.from_numpy(raw.labels[test_rows])
    )


# ---------------------------------------------------------------------------------
# partitions
# ---------------------------------------------------------------------------------


def _partitioner(p: PartitionSettings, num_partitions: int, seed: int):
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        NaturalIdPartitioner,
        PathologicalPartitioner,
    )

    part_seed = derive_seed(seed, "partition") % (2**32)
    if p.name == "dirichlet":
        return DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=p.alpha,
            min_partition_size=p.min_partition_size,
            self_balancing=False,
            seed=part_seed,
        )
    if p.name == "iid":
        return IidPartitioner(num_partitions=num_partitions)
    if p.name == "natural":
        return NaturalIdPartitioner(partition_by="writer")
    if p.name == "pathological":
        # The class assignment of the paper that introduced it (Li et al., 2022):
        # client i's first class is i mod C, so every class is used.
        return PathologicalPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            num_classes_per_partition=p.classes_per_client,
            class_assignment_mode="first-deterministic",
            shuffle=True,
            seed=part_seed,
        )
    raise ValueError(
        f"invalid setting partition.name={p.name!r}: allowed: dirichlet, iid, natural, pathological"
    )


@functools.lru_cache(maxsize=16)
def _partitions(
    split_key: tuple, partition: tuple, num_partitions: int, seed: int
) -> tuple[np.ndarray, ...]:
    from datasets import Dataset

    raw = _raw(split_key[0])
    _, train = _split(split_key)
    p = PartitionSettings(**dict(partition))
    if p.name in NIID_PARTITIONS:  # NIID-Bench's own rules (fedcomp.data.niid)
        parts = niid_partition(
            p.name, raw.labels[train], raw.spec.num_classes, num_partitions, p, seed
        )
        return tuple(train[pos].astype(np.int64) for pos in parts)
    columns = {"index": train, "label": raw.labels[train]}
    if p.name == "natural":
        columns["writer"] = raw.groups[train]
    table = Dataset.from_dict(columns)
    part_seed = derive_seed(seed, "partition") % (2**32)
    if p.name == "iid":
        table = table.shuffle(seed=part_seed)
    partitioner = _partitioner(p, num_partitions, seed)
    partitioner.dataset = table
    if partitioner.num_partitions != num_partitions:  # natural: one per writer present
        raise ValueError(
            f"partition.name={p.name!r} made {partitioner.num_partitions} partitions for "
            f"num_clients={num_partitions}"
        )
    with _quiet_tqdm():
        return tuple(
            np.asarray(partitioner.load_partition(pid)["index"], dtype=np.int64)
            for pid in range(num_partitions)
        )


@contextlib.contextmanager
def _quiet_tqdm() -> Iterator[None]:
    """NaturalIdPartitioner wraps its one pass over the rows in an unconditional tqdm
    bar (tqdm reads TQDM_DISABLE only at import): silence that one name meanwhile."""
    from flwr_datasets.partitioner import natural_id_partitioner as module

    original = getattr(module, "tqdm", None)
    if original is None:
        yield
        return
    module.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        module.tqdm = original


def _partition_key(p: PartitionSettings) -> tuple:
    return tuple(sorted(dataclasses.asdict(p).items()))


def partition_indices(settings: Settings) -> tuple[np.ndarray, ...]:
    """Row ids of every client's partition (rows of :func:`load_raw`)."""
    load_raw(settings.dataset)
    return _partitions(
        _split_key(settings),
        _partition_key(settings.partition),
        settings.num_clients,
        settings.seed,
    )


def client_datasets(settings: Settings, partition_id: int) -> tuple[ArrayDataset, ArrayDataset]:
    """One client's local training and validation sets (only its rows are decoded)."""
    if not 0 <= partition_id < settings.num_clients:
        raise ValueError(
            f"partition id {partition_id} out of range for num_clients={settings.num_clients}"
        )
    raw = load_raw(settings.dataset)
    idx = partition_indices(settings)[partition_id].copy()
    numpy_generator(settings.seed, "val-split", partition_id).shuffle(idx)
    n_val = int(settings.partition.val_fraction * idx.size)
    val, train = np.sort(idx[:n_val]), np.sort(idx[n_val:])
    rows = np.sort(idx)
    features = raw.decode(rows)  # one decode for both parts

    def as_ds(part: np.ndarray) -> ArrayDataset:
        x = features[np.searchsorted(rows, part)]
        return ArrayDataset(torch.from_numpy(x), torch.from_numpy(raw.labels[part]))

    return as_ds(train), as_ds(val)


def check_data_settings(settings: Settings) -> None:
    """Checks that need the data (sizes, a reachable copy), run before Flower or Ray.

    Loads the labels (not the images), cuts the test split and computes every
    partition, so a missing path, a partial copy, too many clients or a partitioner
    that cannot satisfy its settings fails here.

    Raises
    ------
    ValueError
        Naming the keys, the values and the fix (``DataError`` for the copy itself).
    """
    raw = load_raw(settings.dataset)
    name = settings.dataset.name
    _, train_idx = split_rows(settings)
    n_train = int(train_idx.size)
    if settings.num_clients > n_train:
        raise ValueError(
            f"invalid setting num_clients={settings.num_clients}: more clients than the "
            f"{n_train} training samples of dataset '{name}'"
        )
    p = settings.partition
    if p.name in ("dirichlet", "niid_labeldir"):
        needed = settings.num_clients * p.min_partition_size
        if needed > n_train:
            raise ValueError(
                f"invalid setting partition.min_partition_size="
                f"{p.min_partition_size}: num_clients={settings.num_clients} "
                f"x {p.min_partition_size} exceeds the {n_train} training "
                f"samples of dataset '{name}'"
            )
    if p.name in ("pathological", "niid_labels") and p.classes_per_client > raw.spec.num_classes:
        raise ValueError(
            f"invalid setting partition.classes_per_client={p.classes_per_client}: dataset "
            f"'{name}' has {raw.spec.num_classes} classes"
        )
    try:
        parts = partition_indices(settings)
    except ValueError as exc:  # flwr-datasets' own messages, with our keys added
        raise ValueError(
            f"partition.name={p.name!r} cannot split the {n_train} training samples of "
            f"'{name}' among num_clients={settings.num_clients}: {exc}"
        ) from exc
    empty = [i for i, rows in enumerate(parts) if rows.size == 0]
    if empty:
        raise ValueError(
            f"partition.name={p.name!r} left client(s) {empty} without samples "
            f"(num_clients={settings.num_clients}, {n_train} training samples of '{name}'): "
            f"use fewer clients or another partition"
        )
