"""One validation: on a grid of settings combinations, the check that runs before Ray
starts (``fedcomp.settings.validate``) accepts exactly the combinations the ServerApp
can construct its strategy from, and refuses the others with the same message."""

from __future__ import annotations

import itertools

import pytest

from fedcomp.settings import settings_from_dict, validate
from strategies.server_app import build_strategy

CODECS = [
    {"name": "fp32"},
    {"name": "uniform", "bits": 4},
    {"name": "residual", "inner": "uniform", "bits": 2},
    {"name": "ef", "inner": "sign"},
    {"name": "onebit"},
]
HANDOFFS = ["per_client", "pre_aggregated"]
STRATEGIES = ["fedavg", "fedprox", "fedadam", "fedyogi", "fedadagrad", "fedmedian", "fedtrimmedavg"]
TREE_OPTIONS = [
    {},
    {"tree": "balanced"},
    {"dtype": "bf16"},
    {"root_fp32": True},
    {"chunk_size": 1024},
    {"refresh_rounds": 3},
    {"stats": "ema"},
]
EXTRAS = [{}, {"aggregation": {"weight_cap": 0.5}}, {"fraction_evaluate": 1.5}]


def _outcome(fn, settings) -> str:
    try:
        fn(settings)
    except ValueError as exc:
        return str(exc)
    return "ok"


GRID = list(itertools.product(CODECS, HANDOFFS, STRATEGIES, TREE_OPTIONS, EXTRAS))


@pytest.mark.parametrize("chunk", range(4))
def test_pre_ray_check_accepts_exactly_what_the_server_app_constructs(chunk: int) -> None:
    outcomes = set()
    for codec, handoff, strategy, trees, extra in GRID[chunk::4]:
        tree = {
            "codec": codec,
            "strategy": {"name": strategy},
            "aggregation": {"handoff": handoff, **trees, **extra.get("aggregation", {})},
            **{k: v for k, v in extra.items() if k != "aggregation"},
        }
        settings = settings_from_dict(tree)
        before_ray = _outcome(validate, settings)
        server_app = _outcome(build_strategy, settings)
        assert before_ray == server_app, tree
        outcomes.add(before_ray == "ok")
    assert outcomes == {True, False}  # the grid holds both kinds in every chunk


@pytest.mark.parametrize("name", ["fedprox", "fedyogi", "fedadagrad", "fedavgm", "fedadam"])
def test_mean_based_inner_strategies_take_the_pre_aggregated_hand_off(name: str) -> None:
    settings = settings_from_dict(
        {"strategy": {"name": name}, "aggregation": {"handoff": "pre_aggregated"}}
    )
    assert type(build_strategy(settings).strategy).__name__.lower() == name


@pytest.mark.parametrize("name", ["fedmedian", "fedtrimmedavg"])
def test_robust_inner_strategies_take_only_the_per_client_hand_off(name: str) -> None:
    build_strategy(settings_from_dict({"strategy": {"name": name}}))
    with pytest.raises(ValueError, match=rf"strategy\.name='{name}'.*mean-based"):
        validate(
            settings_from_dict(
                {"strategy": {"name": name}, "aggregation": {"handoff": "pre_aggregated"}}
            )
        )
