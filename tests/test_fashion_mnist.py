"""Fashion-MNIST from IDX files (fixtures in the real format, never the installed copy),
NIID-Bench's label-skew partitions checked against their definitions, the NIID-Bench
CNN, SGD weight decay, and the niid_bench_fmnist preset."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from experiments.fixtures import fashion_arrays, idx_bytes, write_fashion_mnist
from experiments.presets import preset_settings, run_inprocess
from fedcomp.data import (
    ArrayDataset,
    DataError,
    check_data_settings,
    load_raw,
    partition_indices,
    split_rows,
)
from fedcomp.data import idx as idx_module
from fedcomp.data.idx import load_fashion_mnist_raw, parse_idx
from fedcomp.data.niid import (
    _one_labeldir_draw,
    assign_labels,
    label_quantity_partition,
    labeldir_partition,
    niid_partition,
)
from fedcomp.models import build_model, num_parameters
from fedcomp.settings import (
    ModelSettings,
    Settings,
    TrainSettings,
    settings_from_dict,
    validate,
)
from fedcomp.training import train_local

TRAIN, TEST = 600, 100


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fmnist")
    return {
        fmt: write_fashion_mnist(root, fmt, TRAIN, TEST) for fmt in ("gz", "raw", "torchvision")
    }


def _settings(path: Path, **extra) -> Settings:
    tree = {"dataset": {"name": "fashion_mnist", "path": str(path)}, "num_clients": 10}
    for key, value in extra.items():
        if isinstance(value, dict):
            tree.setdefault(key, {}).update(value)
        else:
            tree[key] = value
    return validate(settings_from_dict(tree))


# ---------------------------------------------------------------------------------
# the IDX loader
# ---------------------------------------------------------------------------------


def test_every_layout_decodes_the_written_pixels_and_labels(fmnist) -> None:
    train_x, train_y = fashion_arrays(TRAIN, seed=3)
    test_x, test_y = fashion_arrays(TEST, seed=4)
    for fmt, path in fmnist.items():
        raw = load_fashion_mnist_raw(str(path))
        assert len(raw) == TRAIN + TEST, fmt
        np.testing.assert_array_equal(raw.labels, np.concatenate([train_y, test_y]))
        assert raw.test_mask.sum() == TEST and raw.test_mask[TRAIN:].all()
        rows = np.array([TRAIN + 7, 3, 0])  # unsorted, across both splits
        expected = np.stack([test_x[7], train_x[3], train_x[0]])[:, None] / np.float32(255)
        got = raw.decode(rows)
        assert got.dtype == np.float32 and got.shape == (3, 1, 28, 28)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-7)


def test_the_server_tests_on_the_official_split(fmnist) -> None:
    s = _settings(fmnist["gz"], partition={"name": "iid"})
    test_rows, train_rows = split_rows(s)
    np.testing.assert_array_equal(test_rows, np.arange(TRAIN, TRAIN + TEST))
    np.testing.assert_array_equal(train_rows, np.arange(TRAIN))
    assert load_raw(s.dataset).origin == repr(str(fmnist["gz"]))


def test_parse_idx_reads_the_header_big_endian() -> None:
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    data = bytes([0, 0, 0x08, 3]) + (2).to_bytes(4, "big") + (3).to_bytes(4, "big")
    data += (4).to_bytes(4, "big") + array.tobytes()
    assert data == idx_bytes(array)  # the fixture writer writes this layout
    np.testing.assert_array_equal(parse_idx(data, 3, "x"), array)


def _corrupt(tmp_path: Path, source: Path, name: str, content: bytes) -> Path:
    """A copy of the gz fixture with one file replaced by ``content`` (gzipped)."""
    target = tmp_path / "copy"
    shutil.copytree(source, target)
    (target / f"{name}.gz").write_bytes(gzip.compress(content, mtime=0))
    return target


LABELS = "train-labels-idx1-ubyte"
IMAGES = "train-images-idx3-ubyte"
#: A labels header that declares one more label than the bytes that follow.
LONG_HEADER = b"\x00\x00\x08\x01" + (TRAIN + 1).to_bytes(4, "big")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (LABELS, LONG_HEADER + bytes(TRAIN), "declares dimensions"),
        (LABELS, b"\x00\x00\x08\x01\x00", "fewer than an IDX header"),
        (LABELS, b"\x00\x00", "fewer than an IDX magic number"),
        (LABELS, b"\x12\x34\x08\x01" + (1).to_bytes(4, "big") + b"\x00", "magic number"),
        (IMAGES, idx_bytes(np.zeros(TRAIN, np.uint8)), "0x00000801, expected 0x00000803"),
        (LABELS, b"\x00\x00\x0d\x01" + (1).to_bytes(4, "big") + b"\x00", "type code 0x0d"),
        (LABELS, idx_bytes(np.zeros(TRAIN - 1, np.uint8)), "do not belong together"),
        (LABELS, idx_bytes(np.full(TRAIN, 10, np.uint8)), "label 10"),
        (IMAGES, idx_bytes(np.zeros((TRAIN, 32, 32), np.uint8)), "32x32 images, expected 28x28"),
    ],
    ids=["dims-vs-bytes", "short-header", "short-magic", "bad-magic", "labels-as-images", "dtype",
         "count-mismatch", "label-range", "image-size"],
)  # fmt: skip
def test_bad_files_name_the_file_and_the_problem(fmnist, tmp_path, name, content, message) -> None:
    copy = _corrupt(tmp_path, fmnist["gz"], name, content)
    with pytest.raises(DataError, match=message) as info:
        load_fashion_mnist_raw(str(copy))
    assert str(copy / name) in str(info.value)


def test_truncated_gzip_is_a_data_error(fmnist, tmp_path) -> None:
    target = tmp_path / "copy"
    shutil.copytree(fmnist["gz"], target)
    gz = target / f"{IMAGES}.gz"
    gz.write_bytes(gz.read_bytes()[:1000])
    with pytest.raises(DataError, match="truncated or corrupt") as info:
        load_fashion_mnist_raw(str(target))
    assert str(gz) in str(info.value)


def test_missing_data_names_the_package_and_make_data(fmnist, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(idx_module, "DEFAULT_DIR", str(tmp_path / "absent"))
    for path in ("", str(tmp_path / "absent")):
        with pytest.raises(DataError, match="apt-get install dataset-fashion-mnist") as info:
            load_fashion_mnist_raw(path)
        assert "make data" in str(info.value) and str(tmp_path / "absent") in str(info.value)
    partial = tmp_path / "partial"
    shutil.copytree(fmnist["gz"], partial)
    (partial / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="lacks t10k-labels-idx1-ubyte"):
        load_fashion_mnist_raw(str(partial))


# ---------------------------------------------------------------------------------
# NIID-Bench's partitions, from their definitions
# ---------------------------------------------------------------------------------


def _labels(n_per_class: list[int], seed: int = 0) -> np.ndarray:
    labels = np.repeat(np.arange(len(n_per_class)), n_per_class)
    return np.random.default_rng(seed).permutation(labels)


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    every = np.concatenate(parts)
    np.testing.assert_array_equal(np.sort(every), np.arange(n))  # each sample exactly once


def test_labeldir_covers_each_sample_once_and_keeps_the_size_rules() -> None:
    labels = _labels([300, 500, 200, 400, 600, 100, 350, 450, 250, 550])
    n, clients = labels.size, 10
    for beta in (0.1, 0.5, 5.0):
        parts = labeldir_partition(labels, 10, clients, beta, 10, np.random.default_rng(1))
        _assert_exact_cover(parts, n)
        assert min(p.size for p in parts) >= 10
        # The rebalancing rule: labels are dealt in order 0..9, and a client gets no
        # share of label k once it holds N / num_clients samples of labels < k.
        counts = np.array([[np.sum(labels[p] == k) for k in range(10)] for p in parts])
        before = np.cumsum(counts, axis=1) - counts
        assert not np.any((counts > 0) & (before >= n / clients)), beta


def test_labeldir_is_seeded_and_skewed() -> None:
    labels = _labels([400] * 10)

    def run(seed: int) -> list[np.ndarray]:
        return labeldir_partition(labels, 10, 10, 0.5, 10, np.random.default_rng(seed))

    a, b, c = run(3), run(3), run(4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    counts = np.array([[np.sum(labels[p] == k) for k in range(10)] for p in a])
    # An even split gives every client 40 of each label (std 0); Dir(0.5) is far from it.
    assert counts.std() > 20


def test_labeldir_redraws_until_min_size_and_fails_when_impossible() -> None:
    labels = _labels([30] * 10)  # 300 samples
    first = _one_labeldir_draw(labels, 10, 10, 0.5, np.random.default_rng(0))
    assert min(p.size for p in first) < 20  # so the rule needs a redraw from this seed
    parts = labeldir_partition(labels, 10, 10, 0.5, 20, np.random.default_rng(0))
    _assert_exact_cover(parts, labels.size)
    assert min(p.size for p in parts) >= 20
    with pytest.raises(ValueError, match="min_partition_size=31"):
        labeldir_partition(labels, 10, 10, 0.5, 31, np.random.default_rng(0))


@pytest.mark.parametrize(("clients", "k"), [(10, 2), (10, 1), (20, 3), (10, 10), (13, 4)])
def test_label_quantity_gives_each_client_k_labels_split_evenly(clients, k) -> None:
    sizes = [97, 120, 101, 88, 130, 77, 110, 93, 105, 99]
    labels = _labels(sizes)
    parts = label_quantity_partition(labels, 10, clients, k, np.random.default_rng(5))
    _assert_exact_cover(parts, labels.size)
    held = [set(np.unique(labels[p]).tolist()) for p in parts]
    assert all(len(h) == k for h in held)
    assert all(i % 10 in h for i, h in enumerate(held))  # client i's first label
    for label, size in enumerate(sizes):
        shares = [
            np.sum(labels[p] == label) for p, h in zip(parts, held, strict=True) if label in h
        ]
        assert sum(shares) == size and max(shares) - min(shares) <= 1  # array_split


def test_label_assignment_is_seeded_and_checks_k() -> None:
    a = assign_labels(10, 10, 3, np.random.default_rng(7))
    assert a == assign_labels(10, 10, 3, np.random.default_rng(7))
    assert a != assign_labels(10, 10, 3, np.random.default_rng(8))
    with pytest.raises(ValueError, match="classes_per_client=11"):
        assign_labels(10, 10, 11, np.random.default_rng(0))


def test_label_quantity_refuses_to_drop_a_label() -> None:
    labels = _labels([20] * 10)
    with pytest.raises(ValueError, match=r"label\(s\) \[3, 4, 5, 6, 7, 8, 9\] to no client"):
        label_quantity_partition(labels, 10, 3, 1, np.random.default_rng(0))


def test_partition_settings_reach_the_niid_rules(fmnist) -> None:
    train_labels = load_fashion_mnist_raw(str(fmnist["gz"])).labels[:TRAIN]
    c2 = _settings(fmnist["gz"], partition={"name": "niid_labels", "classes_per_client": 2})
    check_data_settings(c2)
    parts = partition_indices(c2)
    _assert_exact_cover(list(parts), TRAIN)  # the training rows only, each once
    assert [len(np.unique(train_labels[p])) for p in parts] == [2] * 10
    d = _settings(fmnist["gz"], partition={"name": "niid_labeldir", "alpha": 0.5}, seed=1)
    parts_d = partition_indices(d)
    _assert_exact_cover(list(parts_d), TRAIN)
    assert min(p.size for p in parts_d) >= d.partition.min_partition_size
    # partition_indices caches: recompute from (seed, settings) without the cache
    again = niid_partition("niid_labeldir", train_labels, 10, 10, d.partition, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(parts_d, again, strict=True))
    other = niid_partition("niid_labeldir", train_labels, 10, 10, d.partition, seed=2)
    assert not all(np.array_equal(x, y) for x, y in zip(parts_d, other, strict=True))
    too_big = _settings(fmnist["gz"], partition={"name": "niid_labels", "classes_per_client": 11})
    with pytest.raises(ValueError, match="classes_per_client=11"):
        check_data_settings(too_big)


# ---------------------------------------------------------------------------------
# the model, weight decay, the preset
# ---------------------------------------------------------------------------------


def test_niid_cnn_has_their_layer_shapes() -> None:
    conv1 = 1 * 6 * 5 * 5 + 6
    conv2 = 6 * 16 * 5 * 5 + 16
    side = ((28 - 4) // 2 - 4) // 2  # two unpadded 5x5 convolutions, each pooled by 2
    fc = (16 * side * side * 120 + 120) + (120 * 84 + 84) + (84 * 10 + 10)
    net = build_model(ModelSettings("niid_cnn", [120, 84]), "fashion_mnist", seed=0)
    assert side == 4 and num_parameters(net) == conv1 + conv2 + fc == 44_426
    with torch.no_grad():
        assert tuple(net.eval()(torch.zeros(3, 1, 28, 28)).shape) == (3, 10)
    cifar = build_model(ModelSettings("niid_cnn", [120, 84]), "cifar10", seed=0)
    assert num_parameters(cifar) == 3 * 6 * 25 + 6 + conv2 + 16 * 25 * 120 + 120 + 84 * 121 + 850
    with pytest.raises(ValueError, match=r"model\.hidden"):
        validate(settings_from_dict({"model": {"name": "niid_cnn", "hidden": [120]}}))
    with pytest.raises(ValueError, match="takes images"):
        build_model(ModelSettings("niid_cnn", [120, 84]), "digits", seed=0)


def test_weight_decay_is_sgds_l2_term() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    model = nn.Linear(4, 3)
    start = [p.detach().clone() for p in model.parameters()]
    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    lr, wd = 0.1, 0.01
    train = TrainSettings(local_epochs=1, batch_size=8, lr=lr, momentum=0.0, weight_decay=wd)
    train_local(model, ArrayDataset(x, y), train, torch.Generator().manual_seed(0))
    for p, p0, g in zip(model.parameters(), start, grads, strict=True):
        torch.testing.assert_close(p.detach(), p0 - lr * (g + wd * p0))
    with pytest.raises(ValueError, match=r"train\.weight_decay"):
        validate(settings_from_dict({"train": {"weight_decay": -1.0}}))
    assert Settings().train.weight_decay == 0.0  # existing runs unchanged


def test_niid_bench_preset_has_their_setting() -> None:
    runs = preset_settings("niid_bench_fmnist")
    assert sorted((s.partition.name, s.seed) for s in runs) == sorted(
        (p, seed) for p in ("niid_labeldir", "niid_labels", "iid") for seed in (0, 1, 2)
    )
    for s in runs:
        validate(s)
        assert (s.dataset.name, s.model.name, s.model.hidden) == (
            "fashion_mnist",
            "niid_cnn",
            [120, 84],
        )
        assert (s.num_clients, s.num_rounds, s.fraction_train) == (10, 50, 1.0)
        t = s.train
        assert (t.local_epochs, t.batch_size, t.lr, t.momentum, t.weight_decay) == (
            10,
            64,
            0.01,
            0.9,
            1e-5,
        )
        assert (s.partition.alpha, s.partition.classes_per_client) == (0.5, 2)
        assert s.partition.val_fraction == 0.0 and s.strategy["name"] == "fedavg"
        assert s.codec["name"] == "fp32"
    assert num_parameters(build_model(runs[0].model, "fashion_mnist", 0)) == 44_426


def test_niid_bench_smoke_learns_and_reports_the_best_round(tmp_path) -> None:
    path = write_fashion_mnist(tmp_path, "gz", train=2000, test=200)
    overrides = [f"dataset.path={path}", "train.local_epochs=5", "train.lr=0.05"]
    # The preset's lr 0.01 and one epoch keep this CNN on its initial loss plateau for
    # the ~3 steps a client makes here (it learns on the real data: docs/experiments.md).
    (s,) = preset_settings("niid_bench_fmnist_smoke", *overrides)
    assert (s.num_rounds, s.partition.name, s.model.name) == (2, "niid_labeldir", "niid_cnn")
    results = run_inprocess(s)
    accuracies = [r["accuracy"] for r in results["rounds"]]
    assert len(accuracies) == 2
    assert results["summary"]["best_accuracy"] == max(accuracies)
    assert results["summary"]["final_accuracy"] == accuracies[-1]
    assert max(accuracies) > 0.5  # 10 classes: chance is 0.1


@pytest.mark.parametrize("name", ["niid_labeldir", "niid_labels"])
def test_niid_partitions_cover_the_training_rows_of_any_dataset(name) -> None:
    # digits' test rows are spread among the training rows (a stratified split), so
    # positions into the training labels must be mapped back to row ids
    s = validate(settings_from_dict({"dataset": {"name": "digits"}, "partition": {"name": name}}))
    test_rows, train_rows = split_rows(s)
    parts = partition_indices(s)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), train_rows)
    assert not np.intersect1d(np.concatenate(parts), test_rows).size


def test_the_leaderboard_presets_run_fedprox_and_compressed_recipes_on_fashion_mnist(
    tmp_path,
) -> None:
    """leaderboard_fmnist's smoke size on a small IDX fixture: FedAvg and FedProx in fp32
    (FedProx's clients get its proximal mu), 1-bit EDEN both ways far below fp32's bytes;
    the full presets sweep 9 recipes x 3 seeds on each label-skew partition."""
    path = write_fashion_mnist(tmp_path, "gz", train=600, test=100)
    runs = {
        (s.strategy["name"], s.codec["name"]): s
        for s in preset_settings("leaderboard_fmnist_smoke", f"dataset.path={path}")
    }
    assert set(runs) == {("fedavg", "fp32"), ("fedprox", "fp32"), ("fedavg", "eden")}
    assert runs["fedprox", "fp32"].strategy["proximal_mu"] == 0.01
    results = {key: run_inprocess(s) for key, s in runs.items()}
    fp32 = results["fedavg", "fp32"]["summary"]["total_wire_bytes"]
    assert results["fedavg", "eden"]["summary"]["total_wire_bytes"] * 10 < fp32
    # the leaderboard ranks the three: FedProx is a recipe, FedAvg alone the reference
    from experiments.leaderboard import rank_recipes

    entries = {e["recipe"]: e for e in rank_recipes(list(results.values()))}
    assert [e["fedavg"] for e in entries.values()].count(True) == 1
    assert entries["up fp32 / down fp32"]["fedavg"]
    final = results["fedavg", "fp32"]["summary"]["final_accuracy"]
    assert [e["target"] for e in entries.values()] == [pytest.approx(final - 0.01)] * 3
    for name, partition in (("leaderboard_fmnist", "niid_labeldir"),
                            ("leaderboard_fmnist_labels", "niid_labels")):  # fmt: skip
        full = preset_settings(name)
        assert len(full) == 9 * 3 and {s.partition.name for s in full} == {partition}
        assert {s.dataset.name for s in full} == {"fashion_mnist"}
        assert sum(s.strategy["name"] == "fedprox" for s in full) == 3
