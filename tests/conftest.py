"""Test set-up: process hygiene before flwr is imported, and shared fixtures."""

from __future__ import annotations

import pytest

import experiments  # noqa: F401  (sets FLWR_TELEMETRY_ENABLED, FLWR_HOME, Ray temp dir)
from experiments.inprocess import set_task_identity


@pytest.fixture(autouse=True)
def _task_identity() -> None:
    """Flower Messages built outside a runtime need the task identity fields."""
    set_task_identity()
