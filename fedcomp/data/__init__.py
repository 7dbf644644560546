"""Datasets and client partitions (no flwr import; flwr-datasets is used for partitioning).

The embedded offline default is ``digits``: the real 8x8 handwritten digits bundled
with scikit-learn (1,797 images, 10 classes). The server keeps a fixed, stratified
held-out test split; the rest is divided among clients with a flwr-datasets
partitioner, and each client holds out part of its partition for client-side
evaluation.
"""

from fedcomp.data.federated import (
    ArrayDataset,
    check_data_settings,
    client_datasets,
    load_arrays,
    partition_indices,
    server_test_set,
)

__all__ = [
    "ArrayDataset",
    "check_data_settings",
    "client_datasets",
    "load_arrays",
    "partition_indices",
    "server_test_set",
]
