"""Data splits, flwr-datasets partitions, models and the results schema."""

from __future__ import annotations

import copy
import itertools
import math

import numpy as np
import pytest
import torch

from fedcomp.data import (
    check_data_settings,
    client_datasets,
    load_arrays,
    partition_indices,
    split_rows,
)
from fedcomp.models import build_model, num_parameters
from fedcomp.results_file import ResultsError, build_results, validate_results
from fedcomp.settings import ModelSettings, Settings, settings_from_dict


def test_partitions_are_disjoint_and_cover_the_training_split() -> None:
    s = Settings()
    parts = partition_indices(s)
    test_idx, train_idx = split_rows(s)
    joined = np.concatenate(parts)
    assert len(parts) == s.num_clients
    assert joined.size == np.unique(joined).size  # disjoint
    assert np.array_equal(np.sort(joined), train_idx)  # every training sample used once
    assert np.intersect1d(train_idx, test_idx).size == 0
    assert min(p.size for p in parts) >= s.partition.min_partition_size


def _mean_top_label_share(settings: Settings) -> float:
    _, y = load_arrays(settings.dataset.name)
    shares = []
    for part in partition_indices(settings):
        counts = np.bincount(y[part], minlength=10)
        shares.append(counts.max() / counts.sum())
    return float(np.mean(shares))


def test_smaller_dirichlet_alpha_means_more_label_skew() -> None:
    skewed = _mean_top_label_share(settings_from_dict({"partition": {"alpha": 0.1}}))
    mild = _mean_top_label_share(settings_from_dict({"partition": {"alpha": 100.0}}))
    iid = _mean_top_label_share(settings_from_dict({"partition": {"name": "iid"}}))
    assert skewed > mild + 0.2
    assert abs(mild - iid) < 0.1  # a huge alpha approaches the IID split


def test_client_split_is_seeded_and_disjoint() -> None:
    s = Settings()
    train_a, val_a = client_datasets(s, 2)
    train_b, val_b = client_datasets(s, 2)
    assert torch.equal(train_a.x, train_b.x) and torch.equal(val_a.y, val_b.y)
    assert len(train_a) + len(val_a) == partition_indices(s)[2].size
    with pytest.raises(ValueError, match="out of range"):
        client_datasets(s, s.num_clients)


def test_more_clients_than_samples_fails_fast() -> None:
    with pytest.raises(ValueError, match=r"num_clients=5000: more clients than the \d+ training"):
        check_data_settings(settings_from_dict({"num_clients": 5000}))
    with pytest.raises(ValueError, match=r"partition\.min_partition_size=200"):
        check_data_settings(settings_from_dict({"partition": {"min_partition_size": 200}}))


def test_default_model_is_big_enough_and_seeded() -> None:
    s = Settings()
    a = build_model(s.model, "digits", seed=3)
    b = build_model(s.model, "digits", seed=3)
    c = build_model(s.model, "digits", seed=4)
    # digits: 8x8 inputs, 10 classes; an MLP of the default widths, weights and biases
    widths = [64, *s.model.hidden, 10]
    expected = sum(i * o + o for i, o in itertools.pairwise(widths))
    assert num_parameters(a) == expected > 10**5
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(next(a.parameters()), next(c.parameters()))
    with pytest.raises(ValueError, match=r"model\.name='vit'"):
        build_model(ModelSettings(name="vit"), "digits", 0)


def _round(i: int) -> dict:
    return {
        "round": i,
        "accuracy": 0.5,
        "loss": 1.0,
        "client_accuracy": None,
        "client_loss": None,
        "uplink_codec_bytes": 10,
        "uplink_record_bytes": 12,
        "uplink_wire_bytes": 20,
        "downlink_record_bytes": 30,
        "downlink_wire_bytes": 40,
        "per_client": [
            {
                "client": 0,
                "uplink_codec_bytes": 10,
                "uplink_record_bytes": 12,
                "uplink_wire_bytes": 20,
                "downlink_record_bytes": 30,
                "downlink_wire_bytes": 40,
                "encode_s": 0.1,
                "num_examples": 5,
            }
        ],
        "decode_s": 0.0,
        "aggregate_s": 0.0,
        "round_s": 0.1,
        "selected": 1,
        "replied": 1,
        "failures": 0,
        "resyncs": 0,
        "nonfinite": 0,
        "faults": {},
        "codec": {
            "fp32_codec_bytes": 40,
            "fp32_wire_bytes": 50,
            "decoded_codec_bytes": 10,
            "decoded_wire_bytes": 20,
        },
    }


def test_results_builder_and_validator() -> None:
    results = build_results({"seed": 0}, [_round(1), _round(2)], wall_s=1.0)
    assert results["summary"]["ratio_vs_fp32_codec"] == 4.0
    assert results["summary"]["ratio_vs_fp32_wire"] == 2.5
    assert results["summary"]["uplink_wire_bytes_total"] == 40
    for mutate, needle in [
        (lambda r: r["rounds"][0].pop("uplink_wire_bytes"), "uplink_wire_bytes"),
        (lambda r: r["rounds"][1].update(round=5), "round"),
        (lambda r: r["rounds"][0].update(loss=math.nan), "non-finite"),
        (lambda r: r["rounds"][0]["per_client"][0].update(client="a"), "client"),
        (lambda r: r.update(schema_version=2), "schema_version"),
        (lambda r: r["summary"].pop("wall_s"), "wall_s"),
    ]:
        broken = copy.deepcopy(results)
        mutate(broken)
        with pytest.raises(ResultsError, match=needle):
            validate_results(broken)


def test_a_socket_section_must_close_its_accounting() -> None:
    """results.json's ``socket`` (deployment runs): its parts add up to its total."""
    results = build_results({"seed": 0}, [_round(1)], wall_s=1.0)
    rnd = {"round": 1, "socket_bytes": 700, "idle_bytes": 50, "calls": 9, "kinds": {}}
    results["socket"] = {
        "counted_nodes": 1,
        "connections": 2,
        "opaque_connections": 0,
        "calls": 12,
        "total_bytes": 1000,
        "setup_bytes": 250,
        "setup_calls": {"GetFab": 250},
        "teardown_bytes": 40,
        "unattributed_bytes": 10,
        "rounds": [rnd],
    }
    assert validate_results(results)["socket"]["total_bytes"] == 1000
    for mutate, needle in [
        (lambda s: s.update(total_bytes=1001), "!= total"),
        (lambda s: s["rounds"][0].update(socket_bytes=699), "!= total"),
        (lambda s: s.pop("setup_bytes"), "setup_bytes"),
        (lambda s: s["rounds"][0].pop("kinds"), r"socket\.rounds\[0\]: missing field\(s\) kinds"),
    ]:
        broken = copy.deepcopy(results)
        mutate(broken["socket"])
        with pytest.raises(ResultsError, match=needle):
            validate_results(broken)
