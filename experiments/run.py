"""The main job: a Hydra-configured Flower simulation that writes results.json.

    python -m experiments.run                                   # defaults (conf/config.yaml)
    python -m experiments.run strategy=fedadam num_rounds=20
    python -m experiments.run -m seed=0,1 partition.alpha=0.1,1.0   # a multirun sweep

Each run writes ``results.json`` in its Hydra run directory.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from experiments.runtime import PROJECT_ROOT, quiet_flower
from fedcomp.failures import RunFailed
from fedcomp.rules import SettingsError
from fedcomp.settings import Settings, settings_from_dict, validate

log = logging.getLogger("experiments.run")

#: Hydra launchers that live in an extra: launcher name prefix -> (plugin module, extra).
LAUNCHER_EXTRAS = {"submitit_": ("hydra_plugins.hydra_submitit_launcher", "slurm")}
#: Launchers that are not supported, and why (docs/scale.md, "Sweeps on Slurm").
UNSUPPORTED_LAUNCHERS = {
    "ray": "hydra-ray-launcher 1.2.2 pins cloudpickle<3, which conflicts with the pinned "
    "dependencies, and runs each job as a Ray task inside which Flower's own Ray use "
    "breaks; sweep on a Ray cluster with simulation.ray_address instead, or on Slurm "
    "with hydra/launcher=submitit_slurm",
}


def check_launcher(argv: list[str]) -> str | None:
    """What is wrong with the ``hydra/launcher=...`` on the command line (None: fine):
    a launcher whose extra is not installed names the extra to install."""
    import importlib.util

    for arg in argv:
        if not arg.startswith(("hydra/launcher=", "+hydra/launcher=")):
            continue
        name = arg.split("=", 1)[1]
        if name in UNSUPPORTED_LAUNCHERS:
            return f"hydra/launcher={name} is not supported: {UNSUPPORTED_LAUNCHERS[name]}"
        for prefix, (module, extra) in LAUNCHER_EXTRAS.items():
            if name.startswith(prefix) and importlib.util.find_spec(module) is None:
                return (
                    f"hydra/launcher={name} needs the launcher plugin from the '{extra}' "
                    f"extra: .venv/bin/pip install -c constraints.txt -e '.[{extra}]'"
                )
    return None


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
    return simulate_settings(settings, verbose=verbose)


def simulate_settings(settings: Settings, *, verbose: bool = False) -> dict[str, Any]:
    """Simulate validated settings and return the results."""
    quiet_flower(verbose)
    from experiments.simulate import simulate

    return simulate(settings, verbose=verbose)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: a thin shell around :func:`run`.

    A bad setting is one line on stderr (the key, the value, what is allowed) and exit
    status 2, before Ray starts; a run that cannot have learned is one line and exit
    status 1 after its results.json is written (in a multirun sweep the next job runs).
    """
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    verbose = bool(OmegaConf.select(cfg, "verbose", default=False))
    if "verbose" in cfg:
        del cfg["verbose"]
    try:
        settings = settings_from_cfg(cfg, str(run_dir / "results.json"))
    except ValueError as exc:  # every settings check raises it, naming key and value
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    try:
        simulate_settings(settings, verbose=verbose)
    except SettingsError as exc:  # the checks before Ray: data, devices, memory
        print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except RunFailed as exc:
        print(f"run failed: {exc}", file=sys.stderr, flush=True)
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            raise SystemExit(1) from None
    log.info("results: %s", run_dir / "results.json")


if __name__ == "__main__":
    problem = check_launcher(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2)
    main()
