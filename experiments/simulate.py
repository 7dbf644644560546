"""One Flower simulation of the configured job (flwr.simulation, Ray backend)."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Any

from experiments.runtime import ray_temp_dir
from fedcomp.codecs import make_codec_from_spec
from fedcomp.data import check_data_settings
from fedcomp.models import check_model
from fedcomp.rules import SettingsError
from fedcomp.settings import Settings, SimulationSettings, ray_host_port, validate


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


def check_ray_cluster(sim: SimulationSettings, timeout: float = 5.0) -> int:
    """The cluster at ``simulation.ray_address`` answers and can host at least one
    client: returns how many clients it runs in parallel (Flower's count, per node).

    Raises ``ValueError`` naming the address when nothing answers there (ray.init
    would retry for minutes) or when no node has the CPUs and GPUs one client asks
    for (Flower would warn and wait forever).
    """
    host_port = ray_host_port(sim.ray_address)
    assert host_port is not None  # checked with the settings
    try:
        socket.create_connection(host_port, timeout=timeout).close()
    except OSError as exc:
        raise ValueError(
            f"invalid setting simulation.ray_address={sim.ray_address!r}: nothing answers "
            f"there ({exc}); start the head with `ray start --head --port=PORT` and use "
            "its address, or leave simulation.ray_address empty for a private local Ray"
        ) from None
    import ray

    ray.init(address=sim.ray_address, logging_level=logging.ERROR, log_to_driver=False)
    try:
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive") and n["Resources"]]
        resources = {"num_cpus": sim.cpus_per_client, "num_gpus": sim.gpus_per_client}
        fits = sum(_clients_on(node, resources) for node in nodes)
    finally:
        ray.shutdown()  # a driver disconnects; the cluster keeps running
    if fits == 0:
        offered = ", ".join(f"CPU={n.get('CPU', 0)} GPU={n.get('GPU', 0)}" for n in nodes)
        raise ValueError(
            f"invalid setting simulation.ray_address={sim.ray_address!r}: no node of that "
            f"cluster has the {sim.cpus_per_client} CPUs and {sim.gpus_per_client} GPUs "
            f"one client asks for (simulation.cpus_per_client, simulation.gpus_per_client); "
            f"its nodes offer: {offered or 'nothing'}"
        )
    return fits


def _clients_on(node: dict[str, float], resources: dict[str, float]) -> int:
    """Clients one Ray node hosts at once (Flower's pool_size_from_resources, per node)."""
    fits = int(node.get("CPU", 0) / resources["num_cpus"])
    if resources["num_gpus"] > 0:
        fits = min(fits, int(node.get("GPU", 0) / resources["num_gpus"]))
    return fits


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
    quiet = {"logging_level": logging.ERROR, "log_to_driver": verbose}
    resources = {"num_cpus": sim.cpus_per_client, "num_gpus": sim.gpus_per_client}
    if sim.ray_address:
        # ray.init refuses num_cpus/num_gpus (and a temp dir) with an address: the
        # cluster's own resources count, and its nodes keep their own directories.
        return {"client_resources": resources, "init_args": {"address": sim.ray_address, **quiet}}
    return {
        "client_resources": resources,
        "init_args": {
            "num_cpus": sim.num_cpus,
            "num_gpus": 0 if sim.gpus_per_client == 0 else None,
            "_temp_dir": ray_temp_dir(),
            "include_dashboard": False,
            **quiet,
        },
    }


def preflight(settings: Settings, *, ray: bool = True) -> None:
    """Every check that can fail, run before Ray starts: values, data sizes, codec and
    strategy specs (each raises ValueError naming the key and the value). With
    ``simulation.ray_address`` the cluster is checked instead of this machine's GPUs;
    ``ray=False`` (the Deployment Engine, which uses no Ray) checks this machine."""
    validate(settings)
    check_model(settings.model, settings.dataset.name)
    check_data_settings(settings)
    if ray and settings.simulation.ray_address:
        check_ray_cluster(settings.simulation)
    else:
        check_devices(settings)
    make_codec_from_spec(settings.codec)
    from strategies.inner import make_inner_strategy
    from strategies.server_app import check_resume

    make_inner_strategy(settings.strategy, settings.num_clients)
    check_resume(settings)  # a malformed or mismatched checkpoint, named, before Ray


def client_state_copies(settings: Settings) -> int:
    """Model-sized arrays each client keeps between rounds: a codec memory holds a
    committed and a pending state (DGC two arrays in each: error and momentum), a
    compressed downlink one replica."""
    from fedcomp.codecs.dgc import DGCMemory
    from fedcomp.codecs.memory import Memory
    from fedcomp.downlink import parse_downlink

    codec = make_codec_from_spec(settings.codec)
    memory = 4 if isinstance(codec, DGCMemory) else 2 if isinstance(codec, Memory) else 0
    return memory + (1 if parse_downlink(settings.downlink).active else 0)


def check_simulation_state(settings: Settings) -> int:
    """Refuse (or warn about) a simulation whose clients' Context.state, all held in
    this process, would not fit in memory (fedcomp.flower.budget.check_client_state).
    Returns the bytes it may take (0 with client_state=disk)."""
    from fedcomp.flower.budget import available_memory, check_client_state
    from fedcomp.models import build_model

    copies = client_state_copies(settings)
    if settings.client_state == "disk" or not copies:
        return 0
    model = build_model(settings.model, settings.dataset.name, settings.seed)
    model_bytes = sum(4 * t.numel() for t in model.state_dict().values())
    return check_client_state(settings.num_clients, model_bytes, copies, available_memory())


def simulate(settings: Settings, *, verbose: bool = False) -> dict[str, Any]:
    """Check everything (before Ray starts), run the simulation, return the results."""
    settings = absolute_paths(settings)
    try:
        preflight(settings)
        check_simulation_state(settings)
    except ValueError as exc:  # every check names the key (or the data) and the value
        raise SettingsError(str(exc)) from exc
    from flwr.simulation import run_simulation

    from clients.client_app import make_client_app
    from clients.paths import paths_of
    from strategies.server_app import make_server_app

    holder: dict[str, Any] = {}
    config = backend_config(settings, verbose=verbose)
    if config["init_args"].get("num_gpus", 0) is None:
        del config["init_args"]["num_gpus"]
    run_simulation(
        server_app=make_server_app(settings, on_results=holder.update),
        # the clients' paths from these local settings, never the server's task
        client_app=make_client_app(paths=paths_of(settings)),
        num_supernodes=settings.num_clients,
        backend_config=config,
    )
    if not holder:
        raise RuntimeError("the simulation ended without results (see the log above)")
    return holder
