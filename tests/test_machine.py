"""results.json's ``machine``: what a run's floating-point trajectory may depend on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedcomp.machine import cpu_model, machine_record
from fedcomp.results_file import ResultsError, validate_results
from tests.test_traffic import _run


def test_the_cpu_model_is_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Some CPU @ 2.0GHz\n")
    assert cpu_model(info) == "Some CPU @ 2.0GHz"
    assert cpu_model(tmp_path / "missing") != ""  # the platform's answer instead


def test_the_record_names_the_kernels_torch_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    record = machine_record()
    assert record["cpu_capability"] == str(torch.backends.cpu.get_cpu_capability())
    assert record["torch"] == torch.__version__ and record["mkl_cbwr"] == "AVX2"
    assert all(isinstance(v, str) for v in record.values())


def test_every_run_records_its_machine_and_the_schema_checks_it() -> None:
    results, _ = _run({"name": "fp32"}, num_rounds=1)
    assert results["machine"] == machine_record()
    validate_results(results)
    with pytest.raises(ResultsError, match="machine"):
        validate_results({**results, "machine": {"cpu": 3}})
