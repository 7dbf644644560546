"""Sweeps across machines: a multirun through hydra-submitit-launcher.

The local executor runs each job of the multirun as its own process, exactly as the
Slurm executor runs each as a Slurm job; only the submission differs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from experiments.run import check_launcher
from experiments.runtime import PROJECT_ROOT
from fedcomp.results_file import load_results

pytestmark = pytest.mark.simulation


@pytest.mark.slow  # about 35 s (two Ray jobs under submitit): `make test-slow` runs it
def test_two_jobs_of_a_multirun_run_as_separate_processes_under_submitit(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "--multirun",
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=10",
        f"hydra.sweep.dir={sweep}",
        "num_clients=2",
        "num_rounds=1",
        "fraction_evaluate=0.0",
        "seed=0,1",
    ]
    proc = subprocess.Popen(
        cmd, cwd=PROJECT_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        log, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, log[-3000:]
    seeds = {}
    for path in sorted(sweep.glob("*/results.json")):
        results = load_results(path)  # validates the schema
        seeds[results["config"]["seed"]] = results
        assert results["rounds"][0]["replied"] == 2
    assert set(seeds) == {0, 1}
    # submitit's local job id is the job's process id: two processes, neither the
    # launcher's own.
    # ("%j" holds the submission itself, before a job id exists)
    jobs = [p.name for p in (sweep / ".submitit").iterdir() if p.name != "%j"]
    assert len(jobs) == 2 and all(j.isdigit() for j in jobs), jobs
    assert len({int(j) for j in jobs} | {proc.pid}) == 3


def test_a_launcher_whose_extra_is_missing_names_the_extra(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("hydra_plugins.hydra_submitit") else real(name),
    )
    problem = check_launcher(["-m", "seed=0,1", "hydra/launcher=submitit_slurm"])
    assert problem is not None and "'.[slurm]'" in problem and "submitit_slurm" in problem
    assert check_launcher(["-m", "seed=0,1"]) is None
    assert "cloudpickle<3" in (check_launcher(["hydra/launcher=ray"]) or "")


def test_a_missing_extra_stops_the_command_before_hydra(tmp_path: Path) -> None:
    """Through the real command line: the unsupported Ray launcher is refused with the
    reason, exit 2, before Hydra composes anything."""
    out = subprocess.run(
        [sys.executable, "-m", "experiments.run", "-m", "hydra/launcher=ray", "seed=0,1"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "hydra/launcher=ray is not supported" in out.stderr
