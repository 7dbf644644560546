"""Hydra composition: the structured schema catches wrong types and unknown keys, and
bad values fail fast (before Ray starts) with the key, the value and what is allowed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from experiments.run import CONF_DIR, settings_from_cfg
from experiments.runtime import PROJECT_ROOT
from fedcomp.settings import Settings


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_default_config_is_the_documented_main_job() -> None:
    s = settings_from_cfg(_compose())
    assert s.dataset.name == "digits" and s.partition.name == "dirichlet"
    assert s.partition.alpha == 0.3 and s.num_clients == 10 and s.num_rounds == 10
    assert s.codec == {"name": "fp32"} and s.strategy == {"name": "fedavg"}
    assert s.simulation.num_cpus == 2
    # conf/ repeats the dataclass defaults where it states them; they must agree.
    assert s == Settings()


def test_groups_and_overrides_compose() -> None:
    s = settings_from_cfg(_compose("strategy=fedadam", "strategy.eta=0.1", "partition.alpha=1.0"))
    assert s.strategy["name"] == "fedadam" and s.strategy["eta"] == 0.1
    assert s.partition.alpha == 1.0
    s = settings_from_cfg(_compose("aggregation=pre_aggregated", "partition=iid"))
    assert s.aggregation.handoff == "pre_aggregated" and s.partition.name == "iid"


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("num_rounds=ten", ValidationError),
        ("partition.alpha=high", ValidationError),
        ("dataset.colour=red", ConfigKeyError),
        ("model.hidden=7", ValidationError),
    ],
)
def test_schema_rejects_wrong_types_and_unknown_keys(override: str, error: type) -> None:
    with pytest.raises((error, ConfigCompositionException)):
        _compose(override)


def test_unknown_group_option_lists_the_available_ones() -> None:
    with pytest.raises(ConfigCompositionException, match="digits"):
        _compose("dataset=mnist")


BAD_VALUES = [
    ("num_rounds=0", "num_rounds=0"),
    ("num_clients=-2", "num_clients=-2"),
    ("num_clients=5000", "num_clients=5000: more clients than"),
    ("partition.alpha=0", "partition.alpha=0.0"),
    ("strategy.name=fedsgd", "strategy.name='fedsgd'"),
    ("+strategy.etaa=0.1", "strategy.etaa"),
    ("codec.name=zip", "unknown codec 'zip'"),
    # Found failing inside the ServerApp after Ray had started (one rule set now).
    ("aggregation.chunk_size=1024", "aggregation.chunk_size=1024: reduction-tree options"),
    ("aggregation.stats=ema", "aggregation.stats='ema': reduction-tree options"),
]


@pytest.mark.parametrize(("override", "needle"), BAD_VALUES)
def test_bad_values_never_reach_the_simulation(
    override: str, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flwr.simulation

    from experiments.simulate import simulate

    def must_not_run(*args, **kwargs):
        raise AssertionError("run_simulation was reached with a bad setting")

    monkeypatch.setattr(flwr.simulation, "run_simulation", must_not_run)
    with pytest.raises(ValueError) as info:
        simulate(settings_from_cfg(_compose(override)))
    assert needle in str(info.value)


@pytest.mark.parametrize(("override", "needle"), BAD_VALUES[:2])
def test_cli_reports_bad_values_and_exits_nonzero(override: str, needle: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "experiments.run", override, "hydra.run.dir=/tmp/fedcomp-bad"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=120,
    )
    assert out.returncode != 0
    assert needle in out.stderr + out.stdout
