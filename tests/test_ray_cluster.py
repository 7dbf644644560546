"""``simulation.ray_address``: a simulation joins an existing Ray cluster.

The test starts a two-node cluster on this machine (ray.cluster_utils.Cluster: a head
and a second node, one CPU each, so one client runs on each), runs a short simulation
through it, reads from the cluster's own tables on which node every client task ran,
and stops what it started."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from experiments.runtime import ray_temp_dir
from experiments.simulate import backend_config, check_ray_cluster, simulate
from fedcomp.settings import settings_from_dict
from tests.ray_processes import await_no_new_ray_processes, ray_processes

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

pytestmark = pytest.mark.simulation


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """A head and a second node; stopped after the module, and every Ray process it
    started must then be gone (ones alive before it began are another module's)."""
    import ray
    from ray._common.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    ray.shutdown()
    before = set(ray_processes())
    # The head writes its address to Ray's default temp dir (RAY_TMPDIR/ray), which on
    # a fresh checkout only a previous ray.init has created.
    Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
    head = Cluster()
    try:
        head.add_node(num_cpus=1, include_dashboard=False, temp_dir=ray_temp_dir())
        head.add_node(num_cpus=1)
        head.wait_for_nodes()
        yield head
    finally:  # also when a node failed to start: stop what did start
        ray.shutdown()
        head.shutdown()
    left = await_no_new_ray_processes(before)
    assert left == [], f"Ray processes of the cluster alive 120 s after it stopped: {left}"


def _where_client_tasks_ran(address: str) -> dict[str, int]:
    """Ray node id -> how many ClientAppActor.run tasks ran there (the cluster's task
    events, matched to the actors' placement in its actor table)."""
    import ray

    ray.init(address=address, log_to_driver=False)
    try:
        actors = ray._private.state.actors()  # the GCS tables: no dashboard needed
        node_of_actor = {
            actor_id: a["Address"]["NodeID"]
            for actor_id, a in actors.items()
            if a["ActorClassName"].endswith("ClientAppActor")
        }
        counts: dict[str, int] = {}
        for event in ray.timeline():
            if event.get("cat") != "task::ClientAppActor.run":
                continue
            # An actor task's id ends with its actor's id.
            task_id = event["args"]["task_id"]
            node = next((n for a, n in node_of_actor.items() if task_id.endswith(a)), None)
            assert node is not None, task_id
            counts[node] = counts.get(node, 0) + 1
        return counts
    finally:
        ray.shutdown()


@pytest.mark.slow  # a two-node Ray cluster: the heaviest test (make test-slow runs it)
def test_a_simulation_runs_its_clients_on_both_nodes_of_a_cluster(cluster) -> None:
    settings = settings_from_dict(
        {
            "num_clients": 4,
            "num_rounds": 1,
            "fraction_evaluate": 0.0,
            "seed": 5,
            "simulation": {"ray_address": cluster.address, "num_cpus": 99},
        }
    )
    config = backend_config(settings)
    assert config["init_args"]["address"] == cluster.address
    assert "num_cpus" not in config["init_args"]  # the cluster's CPUs count
    assert check_ray_cluster(settings.simulation) == 2
    results = simulate(settings)
    (record,) = results["rounds"]
    assert (record["selected"], record["replied"], record["failures"]) == (4, 4, 0)
    ran = _where_client_tasks_ran(cluster.address)
    nodes = {n.node_id for n in cluster.list_all_nodes()}
    assert set(ran) == nodes, (ran, nodes)
    # identity replies + train replies: every client message was served somewhere
    assert sum(ran.values()) >= 4


@pytest.mark.slow  # the same two-node cluster fixture
def test_a_cluster_without_the_resources_a_client_needs_is_refused(cluster) -> None:
    settings = settings_from_dict(
        {"simulation": {"ray_address": cluster.address, "cpus_per_client": 2.0}}
    )
    with pytest.raises(ValueError, match=r"cpus_per_client.*CPU=1\.0 GPU=0, CPU=1\.0 GPU=0") as err:
        simulate(settings)
    assert cluster.address in str(err.value)


def test_an_unreachable_address_fails_before_anything_starts() -> None:
    address = f"127.0.0.1:{_free_port()}"
    settings = settings_from_dict({"simulation": {"ray_address": address}})
    with pytest.raises(ValueError, match=rf"simulation\.ray_address='{address}': nothing answers"):
        simulate(settings)


@pytest.mark.parametrize("address", ["localhost", ":6379", "host:0", "host:99999", "h:p"])
def test_an_address_that_is_not_host_port_names_the_key(address) -> None:
    with pytest.raises(ValueError, match=r"simulation\.ray_address.*host:port"):
        settings_from_dict({"simulation": {"ray_address": address}}).simulation.check()


def test_the_deployment_engine_never_contacts_a_ray_address(monkeypatch) -> None:
    """A run config that still names a Ray cluster deploys without Ray: the launcher's
    preflight checks this machine, and only a simulation contacts the cluster."""
    from experiments import simulate as sim

    address = f"127.0.0.1:{_free_port()}"
    settings = settings_from_dict({"simulation": {"ray_address": address}})
    sim.preflight(settings, ray=False)  # no error: the address is never dialled
    with pytest.raises(ValueError, match="nothing answers"):
        sim.preflight(settings)
