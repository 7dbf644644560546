"""Apps that are not PyTorch: examples/numpy_logreg (float64 weights, an int64 counter)
through the mod and the wrapper, in-process, with several codecs both ways."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from flwr.serverapp.strategy import FedAvg

from experiments.inprocess import InProcessGrid
from experiments.runtime import PROJECT_ROOT
from fedcomp.flower import CompressedStrategy, Reporting

sys.path.insert(0, str(PROJECT_ROOT / "examples" / "numpy_logreg"))
from numpy_logreg.client_app import app as client_app
from numpy_logreg.server_app import initial_arrays

from fedcomp.flower.options import IdentityOptions, ServerOptions

N = 4


@pytest.mark.parametrize(
    ("codec", "downlink"),
    [
        ({"name": "fp32"}, {"name": "fp32"}),
        ({"name": "uniform", "bits": 4}, {"name": "uniform", "bits": 4}),
        ({"name": "ef", "inner": "topk", "fraction": 0.1}, {"name": "sign"}),
        ({"name": "residual", "inner": "uniform", "bits": 2}, {"name": "fp16"}),
    ],
    ids=["fp32", "uniform4", "ef_topk+sign", "residual2+fp16"],
)
def test_a_float64_numpy_app_keeps_its_dtypes_and_learns(codec: dict, downlink: dict) -> None:
    strategy = CompressedStrategy(
        FedAvg(min_available_nodes=N),
        codec=codec,
        downlink=downlink,
        options=ServerOptions(identity=IdentityOptions(timeout=5)),
    )
    result = strategy.start(InProcessGrid(client_app, N), initial_arrays(), num_rounds=3)
    out = {k: np.asarray(v.numpy()) for k, v in result.arrays.items()}
    assert {k: v.dtype for k, v in out.items()} == {
        "w": np.float64,
        "b": np.float64,
        "steps": np.int64,
    }
    assert out["steps"].tolist() == [3]  # integer counters travel exactly
    assert all(r["replied"] == N and not r["rejected"] for r in strategy.rounds)
    assert strategy.rounds[-1]["client_accuracy"] > 0.7  # fp32: 0.93 after 3 rounds


def test_the_round_line_shows_the_client_metrics_the_reporting_settings_name() -> None:
    """Every aggregated client metric is recorded; ``Reporting`` chooses which one is
    ``client_accuracy`` and ``client_loss`` (here deliberately crossed: this app reports
    only ``accuracy``, which is then shown as the loss)."""
    strategy = CompressedStrategy(
        FedAvg(min_available_nodes=N),
        codec={"name": "fp32"},
        reporting=Reporting(accuracy_keys=("no_such_metric",), loss_keys=("x", "accuracy")),
        options=ServerOptions(identity=IdentityOptions(timeout=5)),
    )
    strategy.start(InProcessGrid(client_app, N), initial_arrays(), num_rounds=1)
    (record,) = strategy.rounds
    assert record["client_loss"] == record["client_metrics"]["accuracy"] > 0
    assert record["client_accuracy"] is None


@pytest.mark.parametrize("keys", ["accuracy", ("accuracy", "")])
def test_reporting_refuses_metric_names_that_are_not_a_tuple_of_names(keys) -> None:
    with pytest.raises(ValueError, match=r"accuracy_keys=.*tuple of metric names"):
        Reporting(accuracy_keys=keys)
