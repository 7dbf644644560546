"""Settings: typed conversion, validation messages, and the flat run-config mapping."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from fedcomp.settings import (
    Settings,
    flatten,
    settings_from_dict,
    settings_from_run_config,
    settings_to_dict,
    unflatten,
    validate,
)

ROOT = Path(__file__).resolve().parent.parent


def test_flatten_roundtrip_of_defaults_and_awkward_values() -> None:
    tree = settings_to_dict(Settings())
    tree["codec"] = {"name": "x", "levels": [1, 2], "maybe": None, "s": "json:not-json"}
    flat = flatten(tree)
    assert all(isinstance(v, bool | int | float | str) for v in flat.values())
    assert flat["partition.alpha"] == 0.3
    assert flat["model.hidden"] == "json:[512, 128]"
    assert unflatten(flat) == tree


def test_pyproject_run_config_equals_flattened_defaults() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    table = pyproject["tool"]["flwr"]["app"]["config"]
    assert table == flatten(settings_to_dict(Settings()))
    assert settings_from_run_config(table) == Settings()


def test_run_config_overrides_reach_nested_settings() -> None:
    flat = flatten(settings_to_dict(Settings()))
    flat["partition.alpha"] = 1.5
    flat["model.hidden"] = "json:[64]"
    s = settings_from_run_config(flat)
    assert s.partition.alpha == 1.5
    assert s.model.hidden == [64]


@pytest.mark.parametrize(
    ("tree", "needle"),
    [
        ({"num_rounds": "ten"}, "num_rounds"),
        ({"dataset": {"name": 3}}, "dataset.name"),
        ({"dataset": {"nme": "digits"}}, "dataset.nme"),
        ({"model": {"hidden": "wide"}}, "model.hidden"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_wrong_types_and_unknown_keys_name_the_key(tree: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        settings_from_dict(tree)


@pytest.mark.parametrize(
    ("tree", "key", "value"),
    [
        ({"dataset": {"name": "mnist"}}, "dataset.name", "'mnist'"),
        ({"model": {"name": "resnet"}}, "model.name", "'resnet'"),
        ({"strategy": {"name": "fedsgd"}}, "strategy.name", "'fedsgd'"),
        ({"num_rounds": 0}, "num_rounds", "0"),
        ({"num_rounds": -3}, "num_rounds", "-3"),
        ({"num_clients": 0}, "num_clients", "0"),
        ({"partition": {"alpha": 0.0}}, "partition.alpha", "0.0"),
        ({"partition": {"alpha": -1.0}}, "partition.alpha", "-1.0"),
        ({"fraction_train": 0.0}, "fraction_train", "0.0"),
        ({"aggregation": {"handoff": "tree"}}, "aggregation.handoff", "'tree'"),
    ],
)
def test_bad_values_fail_with_key_value_and_allowed(tree: dict, key: str, value: str) -> None:
    with pytest.raises(ValueError) as info:
        validate(settings_from_dict(tree))
    message = str(info.value)
    assert f"{key}={value}" in message
    assert ("allowed" in message) or ("must" in message)


def test_unknown_name_lists_the_allowed_names() -> None:
    with pytest.raises(ValueError, match="allowed: digits"):
        validate(settings_from_dict({"dataset": {"name": "mnist"}}))
