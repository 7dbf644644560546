"""Settings: typed conversion, validation messages, and the flat run-config mapping."""

from __future__ import annotations

import math
import re
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


# --- issue 41, finding 9: every number finite, every size bounded -----------------


@pytest.mark.parametrize(
    "key",
    [
        "train.lr",
        "partition.alpha",
        "simulation.round_timeout",
        "simulation.cpus_per_client",
        "simulation.gpus_per_client",
        "aggregation.push_side",
        "aggregation.norm_cap",
        "train.momentum",
        "learning_margin",
    ],
)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_every_numeric_setting_refuses_nan_and_infinity_by_name(key, bad):
    """One-sided checks (``x <= 0``) pass NaN: train.lr=nan ran a whole run and then
    failed blaming the compression mod. Every number is checked finite first."""
    group, _, name = key.rpartition(".")
    tree = {group: {name: bad}} if group else {name: bad}
    with pytest.raises(ValueError, match=rf"^invalid setting {re.escape(key)}={bad!r}: "):
        validate(settings_from_dict(tree))


def test_a_codec_parameter_the_codec_does_not_take_fails_before_any_run():
    """codec=residual codec.inner=randk +codec.fraction=0.1 kept residual's bits and
    block: the settings check passed and the run aborted with a traceback."""
    spec = {"name": "residual", "inner": "randk", "bits": 2, "block": 64, "fraction": 0.1}
    with pytest.raises(ValueError, match=r"^invalid setting codec=.*does not take .*bits, block"):
        validate(settings_from_dict({"codec": spec}))
    spec = {"name": "residual", "inner": "randk", "fraction": 0.1}
    validate(settings_from_dict({"codec": spec}))  # the same codec, its own parameters


def test_a_model_larger_than_the_bound_is_refused_before_anything_is_built():
    """model.hidden=[200000, 200000] made a client try to allocate 160 GB before it
    looked at the arrays: sizes are counted on PyTorch's meta device first."""
    from fedcomp.models import MAX_MODEL_ELEMENTS, build_model, model_elements

    wide = settings_from_dict({"model": {"hidden": [200_000, 200_000]}})
    assert model_elements(wide.model, "digits") > MAX_MODEL_ELEMENTS
    with pytest.raises(ValueError, match=r"^invalid setting model\.hidden=\[200000, 200000\]"):
        validate(wide)  # before Ray, and on a client before it allocates anything:
    with pytest.raises(ValueError, match=r"model\.hidden=\[200000, 200000\].*more than"):
        build_model(wide.model, "digits", seed=0)
    fine = settings_from_dict({"model": {"hidden": [256, 256]}})
    elements = sum(t.numel() for t in build_model(fine.model, "digits", 0).state_dict().values())
    assert model_elements(fine.model, "digits") == elements
