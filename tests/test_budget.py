"""A round whose dense updates cannot fit is refused before any instruction leaves."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from clients.client_app import make_client_app
from experiments.inprocess import InProcessGrid
from fedcomp.flower.budget import RoundMemoryError, available_memory, check_round_memory
from fedcomp.models import build_model
from fedcomp.settings import settings_from_dict
from strategies.server_app import run_server


def test_available_memory_reads_the_kernels_estimate(tmp_path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  24000000 kB\nMemFree: 100 kB\nMemAvailable:  1234567 kB\n")
    assert available_memory(meminfo) == 1234567 * 1024
    meminfo.write_text("MemTotal: 1 kB\n")
    assert available_memory(meminfo) is None
    assert available_memory(tmp_path / "absent") is None


def test_the_need_is_refused_above_the_available_and_warned_above_half(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="fedcomp.flower.strategy")
    assert check_round_memory(10, 1000, 2, "m", available=100_000) == 20_000
    assert not caplog.messages
    assert check_round_memory(30, 1000, 2, "m", available=100_000) == 60_000
    assert len(caplog.records) == 1 and "30 clients" in caplog.messages[0]
    with pytest.raises(RoundMemoryError, match=r"each of\s+60 clients.*pre_aggregated"):
        check_round_memory(60, 1000, 2, "m", available=100_000)
    assert check_round_memory(60, 1000, 2, "m", available=None) == 120_000


def _settings(handoff: str, codec: dict) -> object:
    return settings_from_dict(
        {
            "num_clients": 4,
            "num_rounds": 1,
            "fraction_evaluate": 0.0,
            "codec": codec,
            "aggregation": {"handoff": handoff},
            "train": {"local_epochs": 1},
        }
    )


def test_the_wrapper_refuses_a_per_client_round_that_cannot_fit(monkeypatch) -> None:
    """The model's float32 bytes times 4 clients times 2 copies, from the model itself:
    just below it the run fails naming the setting; the streaming mean needs none."""
    settings = _settings("per_client", {"name": "uniform", "bits": 4})
    model = sum(
        np.asarray(v).size * 4
        for v in build_model(settings.model, "digits", 0).state_dict().values()
    )
    need = 4 * model * 2
    monkeypatch.setattr("fedcomp.flower.budget.available_memory", lambda: need - 1)
    with pytest.raises(RoundMemoryError, match=r"aggregation\.handoff=per_client"):
        run_server(InProcessGrid(make_client_app(), 4), settings)
    monkeypatch.setattr("fedcomp.flower.budget.available_memory", lambda: need)
    (record,) = run_server(InProcessGrid(make_client_app(), 4), settings)["rounds"]
    assert record["replied"] == 4
    monkeypatch.setattr("fedcomp.flower.budget.available_memory", lambda: 1)
    streaming = _settings("pre_aggregated", {"name": "uniform", "bits": 4})
    (record,) = run_server(InProcessGrid(make_client_app(), 4), streaming)["rounds"]
    assert record["replied"] == 4


def test_client_state_that_cannot_fit_in_one_process_is_refused_naming_disk(monkeypatch) -> None:
    """A simulation's clients keep their state in the driver: the model's float32 bytes
    x clients x (2 for a codec memory + 1 for a downlink replica), from the model
    itself. Just below it the run is refused naming client_state=disk; with disk (or
    a stateless codec and no downlink) nothing is held."""
    from experiments.simulate import check_simulation_state

    settings = settings_from_dict(
        {
            "num_clients": 1000,
            "codec": {"name": "ef", "inner": "sign"},
            "downlink": {"name": "sign", "memory": "error_feedback"},
        }
    )
    model = sum(
        np.asarray(v).size * 4
        for v in build_model(settings.model, "digits", 0).state_dict().values()
    )
    need = 1000 * model * 3
    monkeypatch.setattr("fedcomp.flower.budget.available_memory", lambda: need)
    assert check_simulation_state(settings) == need
    monkeypatch.setattr("fedcomp.flower.budget.available_memory", lambda: need - 1)
    with pytest.raises(RoundMemoryError, match=r"1000 clients.*client_state=disk"):
        check_simulation_state(settings)
    settings.client_state, settings.client_state_dir = "disk", "/tmp/unused"
    assert check_simulation_state(settings) == 0
    stateless = settings_from_dict({"num_clients": 1000, "codec": {"name": "sign"}})
    assert check_simulation_state(stateless) == 0
    # DGC keeps an error and a momentum per tensor, each committed and pending
    dgc = settings_from_dict(
        {"num_clients": 1000, "codec": {"name": "dgc", "inner": "sparseq", "fraction": 0.01}}
    )
    monkeypatch.setattr("fedcomp.flower.budget.available_memory", lambda: 10**15)
    assert check_simulation_state(dgc) == 1000 * model * 4
