"""FEMNIST, CIFAR-10 and synthetic loaders on fixtures in the real on-disk formats,
their partitions (sizes, label skew), and the errors for bad copies and settings."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest

from experiments.fixtures import cifar_arrays, femnist_rows
from experiments.simulate import preflight
from fedcomp.data import (
    DataError,
    check_data_settings,
    client_datasets,
    load_raw,
    partition_indices,
    server_test_set,
    split_rows,
)
from fedcomp.data.sources import CATALOG, synthetic_arrays
from fedcomp.settings import Settings, settings_from_dict

CIFAR_MEAN = np.array(CATALOG["cifar10"].mean, dtype=np.float32).reshape(1, 3, 1, 1)
CIFAR_STD = np.array(CATALOG["cifar10"].std, dtype=np.float32).reshape(1, 3, 1, 1)


def _femnist(path: Path, **extra) -> Settings:
    tree = {
        "dataset": {"name": "femnist", "path": str(path)},
        "partition": {"name": "natural", "min_partition_size": 5},
        "num_clients": 16,
    }
    for key, value in extra.items():
        if isinstance(value, dict):
            tree.setdefault(key, {}).update(value)
        else:
            tree[key] = value
    return settings_from_dict(tree)


def _cifar(path: Path, **extra) -> Settings:
    tree = {
        "dataset": {"name": "cifar10", "path": str(path)},
        "partition": {"name": "dirichlet", "alpha": 0.3, "min_partition_size": 2},
        "num_clients": 8,
    }
    for key, value in extra.items():
        if isinstance(value, dict):
            tree.setdefault(key, {}).update(value)
        else:
            tree[key] = value
    return settings_from_dict(tree)


# ---------------------------------------------------------------------------------
# loaders: every format gives the same rows, and the right pixels
# ---------------------------------------------------------------------------------


def test_cifar_formats_agree_and_decode_the_written_pixels(data_fixtures) -> None:
    train_x, train_y = cifar_arrays(200, seed=1)
    test_x, test_y = cifar_arrays(40, seed=2)
    rows = np.array([0, 7, 39, 41, 199, 200, 239])  # both splits, both batch edges
    images = np.concatenate([train_x, test_x])[rows].transpose(0, 3, 1, 2)
    expected = (images.astype(np.float32) / 255.0 - CIFAR_MEAN) / CIFAR_STD
    for key in ("cifar_pickle", "cifar_disk", "cifar_parquet"):
        s = _cifar(data_fixtures[key])
        raw = load_raw(s.dataset)
        assert np.array_equal(raw.labels, np.concatenate([train_y, test_y])), key
        np.testing.assert_allclose(raw.decode(rows), expected, rtol=0, atol=1e-6)
        test_rows, train_rows = split_rows(s)
        # The official test split is the server's; test_fraction is not used.
        assert np.array_equal(test_rows, np.arange(200, 240))
        assert np.array_equal(train_rows, np.arange(200))
        test_set = server_test_set(s)
        assert tuple(test_set.x.shape) == (40, 3, 32, 32)
        assert np.array_equal(test_set.y.numpy(), test_y)
    # The torchvision root (the parent of cifar-10-batches-py) works too.
    parent = load_raw(_cifar(data_fixtures["cifar_pickle"].parent).dataset)
    assert np.array_equal(parent.labels, np.concatenate([train_y, test_y]))


def test_femnist_formats_agree_and_keep_the_columns(data_fixtures) -> None:
    columns = femnist_rows()
    disk = load_raw(_femnist(data_fixtures["femnist"]).dataset)
    parquet = load_raw(_femnist(data_fixtures["femnist_parquet"]).dataset)
    for raw in (disk, parquet):
        assert np.array_equal(raw.labels, np.asarray(columns["character"]))
        assert list(raw.groups) == columns["writer_id"]
        assert raw.test_mask is None
    rows = np.array([0, 5, 100, 410])
    expected = np.stack([columns["image"][i] for i in rows])[:, None].astype(np.float32) / 255
    np.testing.assert_array_equal(disk.decode(rows), expected)
    np.testing.assert_array_equal(parquet.decode(rows), expected)


# ---------------------------------------------------------------------------------
# partitions
# ---------------------------------------------------------------------------------


def _writer_sizes() -> dict[str, int]:
    writers, counts = np.unique(femnist_rows()["writer_id"], return_counts=True)
    return dict(zip(writers.tolist(), counts.tolist(), strict=True))


def test_femnist_natural_partition_is_one_writer_per_client(data_fixtures) -> None:
    s = _femnist(data_fixtures["femnist"])
    raw = load_raw(s.dataset)
    sizes = _writer_sizes()
    parts = partition_indices(s)
    test_rows, train_rows = split_rows(s)
    assert len(parts) == 16
    writers = []
    for rows in parts:
        (writer,) = set(raw.groups[rows])  # exactly one writer per client
        writers.append(writer)
        # Its training part: all of its samples but the 20% held out for the server.
        assert rows.size == sizes[writer] - round(0.2 * sizes[writer])
    assert writers == sorted(writers) and len(set(writers)) == 16
    assert set(raw.groups[test_rows]) == set(writers)  # the test split: same writers
    joined = np.concatenate(parts)
    assert np.array_equal(np.sort(joined), train_rows)  # disjoint, cover the training rows
    assert np.intersect1d(test_rows, train_rows).size == 0
    assert all(c.size >= 5 for c in parts)
    # A smaller population is a subset of a larger one (a fixed permutation of writers).
    small = {
        raw.groups[r[0]]
        for r in partition_indices(_femnist(data_fixtures["femnist"], num_clients=4))
    }
    assert small < set(writers)


def test_more_clients_than_writers_fails_naming_the_count(data_fixtures) -> None:
    with pytest.raises(ValueError, match=r"num_clients=21: dataset 'femnist' has 20 writers"):
        check_data_settings(_femnist(data_fixtures["femnist"], num_clients=21))
    # Writers with fewer training samples than min_partition_size are not eligible.
    eligible = sum(n - round(0.2 * n) >= 20 for n in _writer_sizes().values())
    with pytest.raises(ValueError, match=rf"{eligible} of them with at least .*=20"):
        check_data_settings(
            _femnist(
                data_fixtures["femnist"],
                num_clients=eligible + 1,
                partition={"min_partition_size": 20},
            )
        )
    check_data_settings(
        _femnist(
            data_fixtures["femnist"], num_clients=eligible, partition={"min_partition_size": 20}
        )
    )


def _top_label_share(s: Settings) -> float:
    labels = load_raw(s.dataset).labels
    return float(np.mean([np.bincount(labels[p]).max() / p.size for p in partition_indices(s)]))


def test_cifar_label_skew_follows_the_partition_settings(data_fixtures) -> None:
    path = data_fixtures["cifar_disk"]
    skewed = _top_label_share(_cifar(path, partition={"alpha": 0.1}))
    mild = _top_label_share(_cifar(path, partition={"alpha": 1000.0}))
    iid = _cifar(path, partition={"name": "iid"})
    assert skewed > mild + 0.2
    assert abs(mild - _top_label_share(iid)) < 0.1
    assert sorted(p.size for p in partition_indices(iid)) == [25] * 8  # 200 rows / 8
    patho = _cifar(
        path, partition={"name": "pathological", "classes_per_client": 2}, num_clients=16
    )
    labels = load_raw(patho.dataset).labels
    parts = partition_indices(patho)
    for i, rows in enumerate(parts):
        held = set(labels[rows].tolist())
        assert len(held) == 2 and i % 10 in held  # first-deterministic assignment
    assert np.unique(np.concatenate(parts)).size == 200


def test_client_data_is_the_partition_minus_its_validation_rows(data_fixtures) -> None:
    s = _cifar(data_fixtures["cifar_parquet"])
    raw = load_raw(s.dataset)
    rows = partition_indices(s)[3]
    train, val = client_datasets(s, 3)
    assert len(train) + len(val) == rows.size
    assert len(val) == int(0.2 * rows.size)
    assert tuple(train.x.shape[1:]) == (3, 32, 32) and train.x.dtype.is_floating_point
    decoded = raw.decode(np.sort(rows))
    joined = np.concatenate([train.x.numpy(), val.x.numpy()])
    assert sorted(map(bytes, joined)) == sorted(map(bytes, decoded))  # the same images


# ---------------------------------------------------------------------------------
# errors: missing, partial, corrupt, foreign copies; offline hub; model mismatch
# ---------------------------------------------------------------------------------


def test_missing_path_names_it_and_how_to_get_the_data(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "femnist"
    with pytest.raises(DataError, match="no local copy at") as err:
        check_data_settings(_femnist(missing))
    assert str(missing) in str(err.value)
    assert "load_dataset('flwrlabs/femnist', split='train').save_to_disk(" in str(err.value)


def test_unreachable_hub_says_how_to_get_the_data() -> None:
    # tests/conftest.py sets HF_HUB_OFFLINE=1: the hub fails at once, as offline.
    s = settings_from_dict({"dataset": {"name": "cifar10"}, "partition": {"name": "iid"}})
    with pytest.raises(DataError, match="uoft-cs/cifar10 is not reachable") as err:
        check_data_settings(s)
    assert "torchvision.datasets.CIFAR10(" in str(err.value)


def test_partial_and_corrupt_cifar_pickles(data_fixtures, tmp_path: Path) -> None:
    partial = tmp_path / "partial" / "cifar-10-batches-py"
    shutil.copytree(data_fixtures["cifar_pickle"], partial)
    (partial / "data_batch_3").unlink()
    with pytest.raises(DataError, match=r"partial: missing data_batch_3"):
        check_data_settings(_cifar(partial))
    corrupt = tmp_path / "corrupt" / "cifar-10-batches-py"
    shutil.copytree(data_fixtures["cifar_pickle"], corrupt)
    blob = (corrupt / "test_batch").read_bytes()
    (corrupt / "test_batch").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DataError, match=r"test_batch' is not a readable CIFAR-10 python batch"):
        check_data_settings(_cifar(corrupt))


class _Planted:
    """Unpickling this calls ``call(arg)``: a CIFAR batch must never be able to."""

    def __init__(self, call, arg):
        self.call, self.arg = call, arg

    def __reduce__(self):
        return (self.call, (self.arg,))


@pytest.mark.parametrize("how", ["os.system", "builtins.exec"])
def test_a_cifar_batch_that_would_run_code_is_refused(data_fixtures, tmp_path, how) -> None:
    marker = tmp_path / "pwned"
    hostile = tmp_path / "hostile" / "cifar-10-batches-py"
    shutil.copytree(data_fixtures["cifar_pickle"], hostile)
    planted = (
        _Planted(os.system, f"touch {marker}")
        if how == "os.system"
        else _Planted(exec, f"open({str(marker)!r}, 'w').close()")
    )
    batch = {b"data": planted, b"labels": [0]}
    (hostile / "data_batch_2").write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match=r"data_batch_2' is not a readable.*refused the global"):
        check_data_settings(_cifar(hostile))
    assert not marker.exists()


def test_cifar_batches_as_the_archive_writes_them_load(data_fixtures, tmp_path) -> None:
    """The official archive was pickled by numpy 1 (numpy.core.multiarray), the
    fixture by numpy 2 (numpy._core): the restricted unpickler reads both."""
    archive = tmp_path / "archive" / "cifar-10-batches-py"
    shutil.copytree(data_fixtures["cifar_pickle"], archive)
    for name in ("data_batch_1", "test_batch"):
        blob = (archive / name).read_bytes()
        assert b"numpy._core.multiarray\n_reconstruct" in blob  # what is rewritten
        old = blob.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
        (archive / name).write_bytes(old)
    ours = load_raw(_cifar(data_fixtures["cifar_pickle"]).dataset)
    theirs = load_raw(_cifar(archive).dataset)
    assert np.array_equal(ours.labels, theirs.labels)
    rows = np.arange(len(ours.labels))
    assert np.array_equal(ours.decode(rows), theirs.decode(rows))
    assert np.array_equal(ours.test_mask, theirs.test_mask)


def test_corrupt_or_partial_saved_datasets(data_fixtures, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated"
    shutil.copytree(data_fixtures["femnist"], truncated)
    arrow = next(truncated.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:2000])
    with pytest.raises(DataError, match=r"not a readable datasets save_to_disk directory"):
        check_data_settings(_femnist(truncated))
    only_train = tmp_path / "only_train"
    shutil.copytree(data_fixtures["cifar_disk"], only_train)
    shutil.rmtree(only_train / "test")
    (only_train / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(DataError, match=r"no test split .*partial"):
        check_data_settings(_cifar(only_train))


def test_foreign_copies_are_named(tmp_path: Path) -> None:
    import datasets

    other = tmp_path / "mnist_like"
    datasets.Dataset.from_dict({"pixels": [[0] * 4], "y": [1]}).save_to_disk(str(other))
    with pytest.raises(DataError, match=r"missing column\(s\) image, character, writer_id"):
        check_data_settings(_femnist(other))
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match=r"is not a datasets save_to_disk directory or parquet"):
        check_data_settings(_femnist(junk))


def test_images_of_another_size_are_refused(tmp_path: Path) -> None:
    """A 64x64 copy: the models for cifar10 are built for 32x32 inputs."""
    big = tmp_path / "cifar-10-batches-py"
    big.mkdir()
    for name in (
        "data_batch_1",
        "data_batch_2",
        "data_batch_3",
        "data_batch_4",
        "data_batch_5",
        "test_batch",
    ):
        batch = {b"data": np.zeros((4, 3 * 64 * 64), np.uint8), b"labels": [0, 1, 2, 3]}
        (big / name).write_bytes(pickle.dumps(batch, protocol=2))
    with pytest.raises(DataError, match=r"n x 3072 uint8 \(3x32x32 images\)"):
        check_data_settings(_cifar(big))
    import datasets

    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(10)})
    imgs = [np.zeros((64, 64, 3), np.uint8)] * 4
    split = datasets.Dataset.from_dict({"img": imgs, "label": [0, 1, 2, 3]}, features=features)
    hf = tmp_path / "cifar_64"
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(hf))
    with pytest.raises(
        DataError,
        match=r"found 64x64x3 images, but the models for 'cifar10' "
        r"take 32x32x3",
    ):
        check_data_settings(_cifar(hf))


def test_a_model_that_cannot_take_the_inputs_fails_before_ray(data_fixtures) -> None:
    s = settings_from_dict({"model": {"name": "cnn", "hidden": [8, 16, 32]}})
    with pytest.raises(
        ValueError,
        match=r"model.name='cnn' takes images .* 'digits' gives "
        r"vectors of 64 features: use model=mlp",
    ):
        preflight(s)
    s = settings_from_dict(
        {"model": {"name": "resnet18", "hidden": []}, "dataset": {"name": "synthetic"}}
    )
    with pytest.raises(ValueError, match=r"model.name='resnet18' takes images"):
        preflight(s)
    with pytest.raises(ValueError, match=r"natural \(per-writer\) partition needs writer ids"):
        preflight(_cifar(data_fixtures["cifar_disk"], partition={"name": "natural"}))


# ---------------------------------------------------------------------------------
# synthetic
# ---------------------------------------------------------------------------------


def _excess_kurtosis(x: np.ndarray) -> float:
    z = (x - x.mean()) / x.std()
    return float(np.mean(z**4) - 3.0)


def test_synthetic_task_is_seeded_offline_and_heavy_tailed() -> None:
    x, y = synthetic_arrays(6000, 3.0)
    x2, y2 = synthetic_arrays(6000, 3.0)
    assert x.shape == (6000, 64) and x.dtype == np.float32
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert set(np.unique(y).tolist()) == set(range(10))
    # Student-t with 3 degrees of freedom has infinite kurtosis; 100 is near Gaussian (0.06).
    assert _excess_kurtosis(x) > 5.0
    assert abs(_excess_kurtosis(synthetic_arrays(6000, 100.0)[0])) < 0.3
    # The data do not depend on the run seed (paired seeds); the partitions do.
    a = settings_from_dict({"dataset": {"name": "synthetic"}, "seed": 0})
    b = settings_from_dict({"dataset": {"name": "synthetic"}, "seed": 1})
    assert np.array_equal(split_rows(a)[0], split_rows(b)[0])
    assert not all(
        np.array_equal(p, q)
        for p, q in zip(partition_indices(a), partition_indices(b), strict=True)
    )
    check_data_settings(a)
