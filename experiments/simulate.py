"""One Flower simulation of the configured job (flwr.simulation, Ray backend)."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from experiments.runtime import ray_temp_dir
from fedcomp.codecs import make_codec_from_spec
from fedcomp.data import check_data_settings
from fedcomp.models import check_model
from fedcomp.settings import Settings, validate


def check_devices(settings: Settings) -> None:
    """GPUs asked for must exist: Ray would otherwise wait forever for the resource."""
    import torch

    gpus = settings.simulation.gpus_per_client
    if (gpus > 0 or settings.train.device == "cuda") and not torch.cuda.is_available():
        key, value = ("simulation.gpus_per_client", gpus) if gpus > 0 else ("train.device", "cuda")
        raise ValueError(
            f"invalid setting {key}={value!r}: torch sees no CUDA device on this machine "
            "(set simulation.gpus_per_client=0 and train.device=auto)"
        )


def absolute_paths(settings: Settings) -> Settings:
    """Ray workers may start elsewhere: make a relative dataset.path absolute."""
    path = settings.dataset.path
    if not path or os.path.isabs(path):
        return settings
    dataset = dataclasses.replace(settings.dataset, path=os.path.abspath(path))
    return dataclasses.replace(settings, dataset=dataset)


def backend_config(settings: Settings, *, verbose: bool = False) -> dict[str, Any]:
    """Ray resources: parallel clients = num_cpus / cpus_per_client.

    Client errors reach the server in the replies (and are logged there), so the
    actors' own output is forwarded to the driver only when ``verbose``.
    """
    sim = settings.simulation
    return {
        "client_resources": {"num_cpus": sim.cpus_per_client, "num_gpus": sim.gpus_per_client},
        "init_args": {
            "num_cpus": sim.num_cpus,
            "num_gpus": 0 if sim.gpus_per_client == 0 else None,
            "_temp_dir": ray_temp_dir(),
            "include_dashboard": False,
            "logging_level": logging.ERROR,
            "log_to_driver": verbose,
        },
    }


def preflight(settings: Settings) -> None:
    """Every check that can fail, run before Ray starts: values, data sizes, codec and
    strategy specs (each raises ValueError naming the key and the value)."""
    validate(settings)
    check_model(settings.model, settings.dataset.name)
    check_data_settings(settings)
    check_devices(settings)
    make_codec_from_spec(settings.codec)
    from strategies.inner import make_inner_strategy

    make_inner_strategy(settings.strategy, settings.num_clients)


def simulate(settings: Settings, *, verbose: bool = False) -> dict[str, Any]:
    """Check everything (before Ray starts), run the simulation, return the results."""
    settings = absolute_paths(settings)
    preflight(settings)
    from flwr.simulation import run_simulation

    from clients.client_app import make_client_app
    from strategies.server_app import make_server_app

    holder: dict[str, Any] = {}
    config = backend_config(settings, verbose=verbose)
    if config["init_args"]["num_gpus"] is None:
        del config["init_args"]["num_gpus"]
    run_simulation(
        server_app=make_server_app(settings, on_results=holder.update),
        client_app=make_client_app(),
        num_supernodes=settings.num_clients,
        backend_config=config,
    )
    if not holder:
        raise RuntimeError("the simulation ended without results (see the log above)")
    return holder
