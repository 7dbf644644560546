"""The paths a client reads and writes are its own (clients.paths): its node config or
the settings given to make_client_app, never the server's task message."""

from __future__ import annotations

import logging

import pytest
from flwr.app import ArrayRecord

from clients.client_app import make_client_app
from clients.paths import ClientPaths, node_config_of, paths_of, resolve, task_paths
from experiments.deployment.settings import DeploymentSettings, SuperNodeSettings, node_specs
from experiments.inprocess import InProcessGrid
from fedcomp.flower.options import IdentityOptions, ServerOptions
from fedcomp.flower.strategy import CompressedStrategy
from fedcomp.models import build_model
from fedcomp.settings import settings_from_dict
from strategies.inner import make_inner_strategy
from strategies.server_app import client_task

N = 3
RESIDUAL = {"name": "residual", "inner": "uniform", "bits": 2, "block": 64}


def _settings(data_path, **extra):
    return settings_from_dict(
        {
            "num_clients": N,
            "fraction_evaluate": 0.0,
            "dataset": {"name": "cifar10", "path": str(data_path)},
            "partition": {"name": "iid", "min_partition_size": 2},
            "train": {"local_epochs": 1},
            "codec": RESIDUAL,
            **extra,
        }
    )


def _run(settings, task, grid, rounds=2):
    """``rounds`` rounds of the wrapper with ``task`` as the clients' task message."""
    strategy = CompressedStrategy(
        make_inner_strategy({"name": "fedavg"}, N, fraction_evaluate=0.0),
        codec=settings.codec,
        run_seed=settings.seed,
        options=ServerOptions(task=task, identity=IdentityOptions(timeout=5)),
    )
    model = build_model(settings.model, settings.dataset.name, settings.seed)
    strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=rounds)
    return strategy


def _hostile_task(settings, tmp_path):
    """The task a hostile server sends: paths to read and write anywhere."""
    task = client_task(settings)
    task["dataset"] = {**task["dataset"], "path": str(tmp_path / "evil_data")}
    task["client_state_dir"] = str(tmp_path / "evil_state")
    task["diagnostics_dir"] = str(tmp_path / "evil_diag")
    return task


def test_a_task_naming_paths_neither_reads_nor_writes_there(data_fixtures, tmp_path, caplog):
    """The clients read the data they were given and write their memories where they
    were told; the task's data path does not exist (reading it would fail) and its
    directories are never created. One warning names what was ignored."""
    own = tmp_path / "own_state"
    settings = _settings(data_fixtures["cifar_pickle"])
    client = make_client_app(
        paths=ClientPaths(data_path=str(data_fixtures["cifar_pickle"]), state_dir=str(own))
    )
    with caplog.at_level(logging.WARNING, logger="clients.client_app"):
        strategy = _run(settings, _hostile_task(settings, tmp_path), InProcessGrid(client, N))
    assert [(r["replied"], r["failures"]) for r in strategy.rounds] == [(N, 0), (N, 0)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["own_state"]
    assert len(list(own.glob("client-*.npz"))) == N  # the residual memories, written
    warnings = [r.getMessage() for r in caplog.records if "client paths" in r.getMessage()]
    assert len(warnings) == 1
    assert "evil_state" in warnings[0] and "evil_diag" in warnings[0]


def test_the_node_config_names_the_paths_over_the_factory(data_fixtures, tmp_path):
    """A SuperNode's --node-config client-state-dir wins over the factory's paths."""
    settings = _settings(data_fixtures["cifar_pickle"])
    factory = ClientPaths(str(data_fixtures["cifar_pickle"]), str(tmp_path / "factory"))
    grid = InProcessGrid(make_client_app(paths=factory), N)
    for ctxt in grid.contexts.values():
        ctxt.node_config["client-state-dir"] = str(tmp_path / "node")
    _run(settings, client_task(settings), grid, rounds=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node"]
    assert len(list((tmp_path / "node").glob("client-*.npz"))) == N


def test_the_servers_task_carries_no_paths(tmp_path):
    settings = settings_from_dict(
        {
            "dataset": {"name": "cifar10", "path": str(tmp_path / "data")},
            "client_state_dir": str(tmp_path / "state"),
            "diagnostics_dir": str(tmp_path / "diag"),
        }
    )
    task = client_task(settings)
    assert task_paths(task) == {}
    assert "path" not in task["dataset"] and task["dataset"]["name"] == "cifar10"


def test_resolve_prefers_the_node_config_and_refuses_non_strings():
    default = ClientPaths(data_path="d", state_dir="s", diagnostics_dir="g")
    assert resolve({"partition-id": 0}, default) == default
    assert resolve({"client-state-dir": "/n", "data-path": ""}, default) == ClientPaths(
        data_path="", state_dir="/n", diagnostics_dir="g"
    )
    with pytest.raises(ValueError, match=r"node config diagnostics-dir=3: must be a path"):
        resolve({"diagnostics-dir": 3}, default)


def test_the_launcher_gives_every_supernode_the_jobs_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = settings_from_dict(
        {"dataset": {"path": "data"}, "client_state_dir": str(tmp_path / "state")}
    )
    paths = node_config_of(paths_of(settings))
    # relative paths made absolute (a SuperNode runs its ClientApp elsewhere); "" omitted
    assert paths == {
        "data-path": str(tmp_path / "data"),
        "client-state-dir": str(tmp_path / "state"),
    }
    specs = node_specs(DeploymentSettings(), 2, [], client_paths=paths)
    assert [s.node_config for s in specs] == [
        {"partition-id": i, "num-partitions": 2, **paths} for i in range(2)
    ]
    own = DeploymentSettings(supernodes=SuperNodeSettings(node_config={"data-path": "/mine"}))
    (spec,) = node_specs(own, 1, [], client_paths=paths)
    assert spec.node_config["data-path"] == "/mine"
