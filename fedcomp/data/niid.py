"""NIID-Bench's two label-skew partitions (Li, Diao, Chen and He, arXiv 2102.02079),
written from their definitions in NIID-Bench's ``partition_data`` (and Flower's
``baselines/niid_bench``), drawing from an explicit seeded generator.

- ``niid_labeldir`` ("noniid-labeldir"): for each label in turn, its samples are
  shuffled and divided among the clients in proportions drawn from Dir(beta); a client
  that already holds at least N / num_clients samples (N: all training samples) gets
  no share of this label (its proportion is zeroed and the rest renormalized). The
  whole draw is repeated until every client holds at least ``min_size`` samples.
- ``niid_labels`` ("#C=k"): client i holds label ``i % num_classes`` and then k - 1
  other distinct labels drawn uniformly (rejection sampling); each label's shuffled
  samples are split evenly (``np.array_split``) among the clients that hold it.

Both work on the labels of the training rows only and return, per client, positions
into that label array (sorted).
"""

from __future__ import annotations

import numpy as np

from fedcomp.rng import numpy_generator
from fedcomp.settings import PartitionSettings

#: NIID-Bench retries the Dirichlet draw until the size rule holds; this bounds it so
#: an impossible request (too many clients for the samples) fails instead of looping.
MAX_DRAWS = 1000


def _split_points(proportions: np.ndarray, n: int) -> np.ndarray:
    """Cut points of ``n`` shuffled samples for the given proportions (NIID-Bench's
    ``(cumsum(p) * n).astype(int)[:-1]``: floors, so the last client takes the rest)."""
    return (np.cumsum(proportions) * n).astype(int)[:-1]


def _one_labeldir_draw(
    labels: np.ndarray, num_classes: int, num_clients: int, beta: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """One pass over the labels: each label's samples divided by Dir(beta) proportions,
    zeroed for clients already at or above the mean size N / num_clients."""
    cap = labels.size / num_clients
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    for label in range(num_classes):
        idx = np.flatnonzero(labels == label)
        rng.shuffle(idx)
        proportions = rng.dirichlet(np.full(num_clients, beta)) * (sizes < cap)
        total = proportions.sum()
        if not total > 0:  # every open client drew exactly 0 (tiny beta): a failed draw
            return [np.empty(0, dtype=np.int64)] * num_clients
        for client, chunk in enumerate(np.split(idx, _split_points(proportions / total, idx.size))):
            parts[client].append(chunk)
            sizes[client] += chunk.size
    return [np.concatenate(p) if p else np.empty(0, dtype=np.int64) for p in parts]


def labeldir_partition(
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    beta: float,
    min_size: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """NIID-Bench's "noniid-labeldir" partition of ``labels`` (positions per client).

    Raises
    ------
    ValueError
        When no draw in :data:`MAX_DRAWS` gives every client ``min_size`` samples.
    """
    for _ in range(MAX_DRAWS):
        parts = _one_labeldir_draw(labels, num_classes, num_clients, beta, rng)
        if min(p.size for p in parts) >= min_size:
            return [np.sort(p) for p in parts]
    raise ValueError(
        f"no Dirichlet(partition.alpha={beta}) draw in {MAX_DRAWS} gave each of "
        f"num_clients={num_clients} clients at least partition.min_partition_size="
        f"{min_size} of the {labels.size} training samples: use fewer clients, a larger "
        f"alpha or a smaller min_partition_size"
    )


def assign_labels(
    num_clients: int, num_classes: int, k: int, rng: np.random.Generator
) -> list[list[int]]:
    """The labels of each client under "#C=k": ``i % num_classes`` first, then k - 1
    distinct others drawn uniformly (NIID-Bench's rejection loop).

    Raises
    ------
    ValueError
        When ``k`` is not in 1..num_classes.
    """
    if not 1 <= k <= num_classes:
        raise ValueError(
            f"invalid setting partition.classes_per_client={k}: must be in 1..{num_classes} "
            f"(the dataset's classes)"
        )
    held = []
    for client in range(num_clients):
        current = [client % num_classes]
        while len(current) < k:
            label = int(rng.integers(num_classes))
            if label not in current:
                current.append(label)
        held.append(current)
    return held


def label_quantity_partition(
    labels: np.ndarray, num_classes: int, num_clients: int, k: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """NIID-Bench's "#C=k" partition of ``labels`` (positions per client).

    Raises
    ------
    ValueError
        When ``k`` is out of range, or a label present in the data is held by no
        client (fewer clients than classes: NIID-Bench would drop its samples).
    """
    held = assign_labels(num_clients, num_classes, k, rng)
    holders = [[c for c in range(num_clients) if label in held[c]] for label in range(num_classes)]
    orphans = [lab for lab in range(num_classes) if not holders[lab] and np.any(labels == lab)]
    if orphans:
        raise ValueError(
            f"partition.name='niid_labels' with num_clients={num_clients} and "
            f"classes_per_client={k} gives label(s) {orphans} to no client, so their "
            f"samples would be lost: use at least {num_classes} clients or more labels "
            f"per client"
        )
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for label in range(num_classes):
        idx = np.flatnonzero(labels == label)
        rng.shuffle(idx)
        if not holders[label]:
            continue
        chunks = np.array_split(idx, len(holders[label]))
        for client, chunk in zip(holders[label], chunks, strict=True):
            parts[client].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


#: The partition names (``partition.name``) this module implements.
NIID_PARTITIONS = ("niid_labeldir", "niid_labels")


def niid_partition(
    name: str,
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    settings: PartitionSettings,
    seed: int,
) -> list[np.ndarray]:
    """Positions into ``labels`` of every client under ``name`` (one of
    :data:`NIID_PARTITIONS`), drawn from a generator derived from (seed, name).

    ``partition.alpha`` is NIID-Bench's beta, ``partition.min_partition_size`` its
    minimum size (10 there), ``partition.classes_per_client`` its k.
    """
    rng = numpy_generator(seed, "partition", name)
    if name == "niid_labeldir":
        return labeldir_partition(
            labels, num_classes, num_clients, settings.alpha, settings.min_partition_size, rng
        )
    if name == "niid_labels":
        return label_quantity_partition(
            labels, num_classes, num_clients, settings.classes_per_client, rng
        )
    raise ValueError(f"partition.name={name!r}: allowed: {', '.join(NIID_PARTITIONS)}")
