"""Run an experiment preset's sweep in this process, without Ray.

    python -m experiments.presets bidirectional_digits [seed=0,1] [--out-dir DIR]

Each run is the real ClientApp and ServerApp code driven through an in-process grid
(experiments.inprocess), so its per-round numbers are those of the Hydra + Ray command
``python -m experiments.run -m +experiment=<name>`` (tests/test_presets.py checks this on
the FEMNIST smoke preset); only the Ray start-up and the process per client are saved.
Results go to ``<out-dir>/<i>/results.json`` in the sweep's order, as Hydra numbers
them (default out-dir: the preset's ``hydra.sweep.dir``). Overrides of a swept key
replace its values; others apply to every run.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException

from experiments.run import CONF_DIR, settings_from_cfg
from experiments.simulate import preflight
from fedcomp.failures import RunFailed
from fedcomp.settings import Settings


def sweep_axes(name: str) -> tuple[dict[str, list[str]], str]:
    """The preset's sweep (each swept key's values) and its output directory."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        hc = compose("config", [f"+experiment={name}"], return_hydra_config=True)
    axes = {k: str(v).split(",") for k, v in hc.hydra.sweeper.params.items()}
    return axes, str(hc.hydra.sweep.dir)


def compose_runs(
    name: str, fixed: Sequence[str], combos: Sequence[Sequence[str]]
) -> list[Settings]:
    base = [f"+experiment={name}", *fixed]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return [settings_from_cfg(compose("config", [*base, *combo])) for combo in combos]


def preset_settings(name: str, *overrides: str) -> list[Settings]:
    """Settings of every run of ``python -m experiments.run -m +experiment=<name>
    <overrides>``, in Hydra's order: an override of a swept key replaces its values
    (``seed=0,1``)."""
    axes, _ = sweep_axes(name)
    fixed = []
    for override in parse_overrides(overrides):
        if override.is_sweep_override():  # a sweep of its own, or new values for one
            axes[override.key_or_group] = list(override.sweep_string_iterator())
        elif override.key_or_group in axes and override.type.name == "CHANGE":
            axes[override.key_or_group] = [override.get_value_element_as_str()]
        else:
            fixed.append(override.input_line)
    grid = [[f"{k}={v}" for v in values] for k, values in axes.items()]
    return compose_runs(name, fixed, list(itertools.product(*grid)))


def parse_overrides(overrides: Sequence[str]) -> list:
    """Hydra's override grammar (``key=value``, ``~key`` deletes, ``+key=value`` adds,
    ``++key=value`` adds or sets, ``key=a,b`` sweeps); ValueError in one line naming
    the override Hydra refuses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    parsed = []
    for override in overrides:
        try:
            parsed.extend(parser.parse_overrides([override]))
        except HydraException as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"invalid override {override!r}: {first}") from None
    return parsed


def run_inprocess(settings: Settings) -> dict:
    """The real ClientApp and ServerApp, one process, no Ray."""
    from clients.client_app import make_client_app
    from clients.paths import paths_of
    from experiments.inprocess import InProcessGrid, set_task_identity
    from experiments.simulate import check_simulation_state
    from strategies.server_app import run_server

    check_simulation_state(settings)  # every client's Context.state is in this process
    set_task_identity()
    ids = [10_000 + i for i in range(settings.num_clients)]
    return run_server(
        InProcessGrid(
            make_client_app(paths=paths_of(settings)), settings.num_clients, node_ids=ids
        ),
        settings,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a preset in conf/experiment/")
    parser.add_argument("overrides", nargs="*", help="key=value (swept keys: a,b,c)")
    parser.add_argument("--out-dir", type=Path, help="default: the preset's sweep dir")
    parser.add_argument("--skip-done", action="store_true", help="keep existing results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        runs = preset_settings(args.name, *args.overrides)
        for settings in runs:  # every run's settings, before the first one starts
            preflight(settings, ray=False)
    except (ValueError, HydraException) as exc:  # one line: key, value, what is allowed
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        print(f"error: {first}", file=sys.stderr)
        return 2
    out_dir = args.out_dir or Path(sweep_axes(args.name)[1])
    t0 = time.perf_counter()
    failed = 0
    for i, settings in enumerate(runs):
        path = out_dir / str(i) / "results.json"
        if args.skip_done and path.exists():
            continue
        settings.results_path = str(path)
        if not settings.client_state_dir:  # as experiments.run: a resume keeps them
            settings.client_state_dir = str(path.parent / "client_state")
        settings.progress = "off"
        try:
            results = run_inprocess(settings)
        except Exception as exc:  # its results.json says why; the sweep goes on
            kind = "" if isinstance(exc, RunFailed) else f"{type(exc).__name__}: "
            print(f"[{i + 1}/{len(runs)}] {path}: FAILED: {kind}{exc}", flush=True)
            failed += 1
            continue
        s = results["summary"]
        print(
            f"[{i + 1}/{len(runs)}] {path}: final accuracy {s['final_accuracy']:.4f} "
            f"(best {s['best_accuracy']:.4f}), "
            f"total {s['total_wire_bytes'] / 1e6:.2f} MB ({s['total_ratio_vs_fp32']:.2f}x), "
            f"{time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    if failed:
        print(f"{failed} of {len(runs)} runs failed (their results.json say how)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
