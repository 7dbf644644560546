"""Datasets and client partitions (no flwr import; flwr-datasets is used for partitioning).

The embedded offline default is ``digits``: the real 8x8 handwritten digits bundled
with scikit-learn (1,797 images, 10 classes). ``femnist`` (natural per-writer
partitions) and ``cifar10`` come from a local copy or the hub (``fedcomp.data.sources``),
``fashion_mnist`` from its IDX files (``fedcomp.data.idx``);
``synthetic`` is a generated task with heavy-tailed (Student-t) features. The server
keeps a fixed held-out test split; the rest is divided among clients with a
flwr-datasets partitioner, and each client holds out part of its partition for
client-side evaluation.
"""

from fedcomp.data.federated import (
    ArrayDataset,
    check_data_settings,
    client_datasets,
    load_arrays,
    load_raw,
    partition_indices,
    server_test_set,
    split_rows,
)
from fedcomp.data.sources import CATALOG, DataError, DatasetSpec

__all__ = [
    "CATALOG",
    "ArrayDataset",
    "DataError",
    "DatasetSpec",
    "check_data_settings",
    "client_datasets",
    "load_arrays",
    "load_raw",
    "partition_indices",
    "server_test_set",
    "split_rows",
]
