"""The job on Flower's Deployment Engine: a Hydra entry point around the launcher.

    python -m experiments.deploy                                 # deployment=local
    python -m experiments.deploy num_rounds=3 codec=uniform8     # any experiment override
    python -m experiments.deploy deployment=multi_gpu num_clients=8
    python -m experiments.deploy deployment=edge deployment.superlink.address=fl.example.org:9093

The config is ``conf/deploy.yaml``: the experiment of ``conf/config.yaml`` plus the
``deployment`` group (``conf/deployment/``, schema :mod:`experiments.deployment.settings`).
``results.json`` lands in the Hydra run directory, as with ``experiments.run``;
process logs and the staged app in its ``deploy/`` subdirectory. Exit code 1 on a
failure (the message names the component), 130 on Ctrl-C; either way every process
the launcher started is stopped.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from experiments.deployment.settings import DeploymentSettings
from experiments.run import CONF_DIR, settings_from_cfg
from experiments.runtime import quiet_flower
from fedcomp.settings import Settings

log = logging.getLogger("experiments.deploy")


@dataclass
class DeployConfig(Settings):
    """Hydra schema of ``conf/deploy.yaml``: the run's settings plus the deployment."""

    deployment: DeploymentSettings = field(default_factory=DeploymentSettings)


@contextlib.contextmanager
def deploy_schema() -> Iterator[None]:
    """Compose with :class:`DeployConfig` as the root schema, then restore Settings.

    ``conf/config.yaml`` starts from the structured config ``base_settings``
    (:class:`Settings`, registered by ``experiments.run``), whose struct mode rejects a
    ``deployment`` key, and OmegaConf refuses to merge it into any other schema. So
    ``conf/deploy.yaml`` reuses ``config.yaml`` unchanged while ``base_settings`` names
    :class:`DeployConfig` (a subclass: the same keys plus ``deployment``), and only
    for the duration of this composition.
    """
    store = ConfigStore.instance()
    store.store(name="base_settings", node=DeployConfig)
    try:
        yield
    finally:
        store.store(name="base_settings", node=Settings)


def split_cfg(cfg: DictConfig) -> tuple[DictConfig, DeploymentSettings]:
    """Separate the run's settings from the deployment (which never enters the run)."""
    tree: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    merged = OmegaConf.merge(OmegaConf.structured(DeploymentSettings), tree.pop("deployment"))
    return OmegaConf.create(tree), OmegaConf.to_object(merged)  # type: ignore[return-value]


def deploy(cfg: DictConfig, run_dir: Path, *, verbose: bool = False) -> dict[str, Any]:
    """Validate everything (before any process starts), deploy, run, stop; return results."""
    from experiments.deployment.launcher import Launch, launch
    from fedcomp.flower.round_records import fmt, log_line

    run_cfg, deployment = split_cfg(cfg)
    settings = settings_from_cfg(run_cfg)
    quiet_flower(verbose)
    state = Launch(run_dir)
    results = launch(settings, deployment, run_dir, state=state)
    t = state.timings
    log.info(
        "SuperLink ready in %.1f s, run %.1f s, %.1f s from the first start to the last stop; "
        "%d SuperNode(s); the launcher's own peak memory %.0f MB",
        t["superlink_ready_s"],
        t["run_s"],
        t["total_s"],
        len(state.components) - 1,
        state.peak_rss_mb,
    )
    for record in results["rounds"]:
        log.info(log_line(record, settings.num_rounds))
    s = results["summary"]
    log.info(
        "done: final accuracy %s | uplink wire %d B in %d rounds | ratio vs fp32: codec %s "
        "wire %s | results.json and process logs in %s",
        fmt(s["final_accuracy"]),
        s["uplink_wire_bytes_total"],
        len(results["rounds"]),
        fmt(s["ratio_vs_fp32_codec"]),
        fmt(s["ratio_vs_fp32_wire"]),
        run_dir,
    )
    return results


@hydra.main(config_path=CONF_DIR, config_name="deploy", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: exit 1 naming the failing component, 130 on Ctrl-C."""
    from experiments.deployment.processes import DeploymentError, Interrupted

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    verbose = bool(OmegaConf.select(cfg, "verbose", default=False))
    if "verbose" in cfg:
        del cfg["verbose"]
    try:
        deploy(cfg, run_dir, verbose=verbose)
    except (ValueError, DeploymentError) as exc:
        log.error("deployment failed: %s", exc)
        sys.exit(1)
    except (KeyboardInterrupt, Interrupted) as exc:
        log.error("interrupted (%s); every process started was stopped", str(exc) or "SIGINT")
        sys.exit(130)


if __name__ == "__main__":
    with deploy_schema():
        main()
