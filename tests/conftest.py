"""Test set-up: process hygiene before flwr is imported, and shared fixtures."""

from __future__ import annotations

import os
import signal
from pathlib import Path

# Nothing downloads at test time: datasets and huggingface_hub fail at once when a
# test asks for a hub dataset (they read these when first imported).
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from hypothesis import settings as hypothesis_settings

import experiments  # noqa: F401  (sets FLWR_TELEMETRY_ENABLED, FLWR_HOME, Ray temp dir)
from experiments.inprocess import set_task_identity

# Property tests replay: `make test` draws the same cases every run (derandomized, no
# example database), so a CI failure reproduces as it is; `make fuzz` draws new cases
# from a seed it prints (FEDCOMP_HYPOTHESIS_PROFILE=fuzz with --hypothesis-seed).
hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
hypothesis_settings.register_profile("fuzz", database=None, print_blob=True)
hypothesis_settings.load_profile(os.environ.get("FEDCOMP_HYPOTHESIS_PROFILE", "ci"))


# Flower Messages built outside a runtime need the task identity fields; set them at
# import too, for code that runs while the test modules are collected.
set_task_identity()


#: The runner's own signal handlers. ray.init (a simulation test) leaves one in the
#: driver that turns SIGTERM into SystemExit: pytest then reports it as the running
#: test's failure and goes on, where a stopped CI job must stop.
_SIGNALS = {
    sig: handler
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    if (handler := signal.getsignal(sig)) is not None
}


def _reset_process_state() -> None:
    """What every test may assume of the process, whatever ran before it: Flower's task
    identity set, torch's global generator at seed 0 (a test or fixture that draws from
    it, torch.randn without a generator, sees the same numbers in any order), and the
    runner's signal handlers."""
    import torch

    set_task_identity()
    torch.manual_seed(0)
    for sig, handler in _SIGNALS.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of the test is set up: module- and session-scoped fixtures
    are created during the setup of whichever test needs them first, before any
    function-scoped fixture runs, so an autouse fixture alone would leave them seeing
    what the previous test (in a shuffled order, any test) left behind."""
    _reset_process_state()


@pytest.fixture(autouse=True)
def _process_state() -> None:
    """And again after the wider-scoped fixtures, in case one of them changed it."""
    _reset_process_state()


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    """Print the shuffle seed at the end (pytest-randomly shows it only in the header,
    which -q hides): a failing order replays with ``--randomly-seed=N``."""
    if config.pluginmanager.hasplugin("randomly"):
        seed = config.getoption("randomly_seed")
        terminalreporter.write_line(
            f"test order: --randomly-seed={seed} (replay: make test TEST_SEED={seed})"
        )


@pytest.fixture(scope="session")
def data_fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny FEMNIST and CIFAR-10 copies in every supported on-disk format
    (experiments.fixtures): keys femnist, femnist_parquet, cifar_pickle, cifar_disk,
    cifar_parquet; values are what ``dataset.path`` takes."""
    from experiments.fixtures import write_cifar10, write_femnist

    root = tmp_path_factory.mktemp("data")
    return {
        "femnist": write_femnist(root, "disk"),
        "femnist_parquet": write_femnist(root, "parquet"),
        "cifar_pickle": write_cifar10(root, "pickle"),
        "cifar_disk": write_cifar10(root, "disk"),
        "cifar_parquet": write_cifar10(root, "parquet"),
    }
