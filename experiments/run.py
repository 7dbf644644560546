"""The main job: a Hydra-configured Flower simulation that writes results.json.

    python -m experiments.run                                   # defaults (conf/config.yaml)
    python -m experiments.run strategy=fedadam num_rounds=20
    python -m experiments.run -m seed=0,1 partition.alpha=0.1,1.0   # a multirun sweep

Each run writes ``results.json`` in its Hydra run directory.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from experiments.runtime import PROJECT_ROOT, quiet_flower
from fedcomp.settings import Settings, settings_from_dict, validate

log = logging.getLogger("experiments.run")

CONF_DIR = str(PROJECT_ROOT / "conf")

ConfigStore.instance().store(name="base_settings", node=Settings)


def settings_from_cfg(cfg: DictConfig, results_path: str = "") -> Settings:
    """Turn a composed Hydra config into validated :class:`Settings`."""
    tree: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    tree.pop("hydra", None)
    if results_path:
        tree["results_path"] = results_path
        if not tree.get("client_state_dir"):
            tree["client_state_dir"] = str(Path(results_path).parent / "client_state")
    return validate(settings_from_dict(tree))


def run(cfg: DictConfig, run_dir: Path, *, verbose: bool = False) -> dict[str, Any]:
    """Validate the config (before Ray starts), simulate, return the results."""
    settings = settings_from_cfg(cfg, str(run_dir / "results.json"))
    quiet_flower(verbose)
    from experiments.simulate import simulate

    return simulate(settings, verbose=verbose)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: a thin shell around :func:`run`."""
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    verbose = bool(OmegaConf.select(cfg, "verbose", default=False))
    if "verbose" in cfg:
        del cfg["verbose"]
    run(cfg, run_dir, verbose=verbose)
    log.info("results: %s", run_dir / "results.json")


if __name__ == "__main__":
    main()
