"""Loading, splitting and partitioning: the data side of one federated task."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

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


@functools.lru_cache(maxsize=4)
def load_arrays(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Return all features (float32, scaled to [0, 1]) and labels (int64) of a dataset."""
    if name == "digits":
        from sklearn.datasets import load_digits

        bunch = load_digits()
        x = (bunch.data / 16.0).astype(np.float32)
        y = bunch.target.astype(np.int64)
        return x, y
    raise ValueError(f"invalid setting dataset.name={name!r}: allowed: digits")


@functools.lru_cache(maxsize=4)
def _test_train_indices(name: str, test_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """A stratified split: the same test images for every run seed."""
    _, y = load_arrays(name)
    rng = numpy_generator(TEST_SPLIT_SEED, "test-split", name)
    test, train = [], []
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        rng.shuffle(idx)
        n_test = round(test_fraction * idx.size)
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    return np.sort(np.concatenate(test)), np.sort(np.concatenate(train))


def server_test_set(dataset: DatasetSettings) -> ArrayDataset:
    """The server's held-out test split (centralized evaluation)."""
    x, y = load_arrays(dataset.name)
    test_idx, _ = _test_train_indices(dataset.name, dataset.test_fraction)
    return ArrayDataset(torch.from_numpy(x[test_idx]), torch.from_numpy(y[test_idx]))


@functools.lru_cache(maxsize=16)
def _partitions(
    name: str,
    test_fraction: float,
    partition: str,
    num_partitions: int,
    alpha: float,
    min_partition_size: int,
    seed: int,
) -> tuple[np.ndarray, ...]:
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner

    _, y = load_arrays(name)
    _, train_idx = _test_train_indices(name, test_fraction)
    table = Dataset.from_dict({"index": train_idx, "label": y[train_idx]})
    part_seed = derive_seed(seed, "partition") % (2**32)
    if partition == "dirichlet":
        partitioner = DirichletPartitioner(
            num_partitions=num_partitions,
            partition_by="label",
            alpha=alpha,
            min_partition_size=min_partition_size,
            self_balancing=False,
            seed=part_seed,
        )
    elif partition == "iid":
        partitioner = IidPartitioner(num_partitions=num_partitions)
        table = table.shuffle(seed=part_seed)
    else:
        raise ValueError(f"invalid setting partition.name={partition!r}: allowed: dirichlet, iid")
    partitioner.dataset = table
    return tuple(
        np.asarray(partitioner.load_partition(pid)["index"], dtype=np.int64)
        for pid in range(num_partitions)
    )


def partition_indices(settings: Settings) -> tuple[np.ndarray, ...]:
    """Indices (into the full dataset) of every client's partition."""
    p: PartitionSettings = settings.partition
    return _partitions(
        settings.dataset.name,
        settings.dataset.test_fraction,
        p.name,
        settings.num_clients,
        p.alpha,
        p.min_partition_size,
        settings.seed,
    )


def client_datasets(settings: Settings, partition_id: int) -> tuple[ArrayDataset, ArrayDataset]:
    """One client's local training and validation sets."""
    if not 0 <= partition_id < settings.num_clients:
        raise ValueError(
            f"partition id {partition_id} out of range for num_clients={settings.num_clients}"
        )
    x, y = load_arrays(settings.dataset.name)
    idx = partition_indices(settings)[partition_id].copy()
    numpy_generator(settings.seed, "val-split", partition_id).shuffle(idx)
    n_val = int(settings.partition.val_fraction * idx.size)
    val, train = np.sort(idx[:n_val]), np.sort(idx[n_val:])
    as_ds = lambda ix: ArrayDataset(torch.from_numpy(x[ix]), torch.from_numpy(y[ix]))  # noqa: E731
    return as_ds(train), as_ds(val)


def check_data_settings(settings: Settings) -> None:
    """Checks that need the data (sizes), run before any Flower or Ray start.

    Raises
    ------
    ValueError
        When the clients cannot all get a partition, naming the keys and values.
    """
    load_arrays(settings.dataset.name)  # fails early on an unknown dataset
    _, train_idx = _test_train_indices(settings.dataset.name, settings.dataset.test_fraction)
    n_train = int(train_idx.size)
    if settings.num_clients > n_train:
        raise ValueError(
            f"invalid setting num_clients={settings.num_clients}: more clients than the "
            f"{n_train} training samples of dataset '{settings.dataset.name}'"
        )
    if settings.partition.name == "dirichlet":
        needed = settings.num_clients * settings.partition.min_partition_size
        if needed > n_train:
            raise ValueError(
                f"invalid setting partition.min_partition_size="
                f"{settings.partition.min_partition_size}: num_clients={settings.num_clients} "
                f"x {settings.partition.min_partition_size} exceeds the {n_train} training "
                f"samples of dataset '{settings.dataset.name}'"
            )
