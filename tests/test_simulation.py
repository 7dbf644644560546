"""End-to-end proof on the real runtime: Flower's simulation engine with Ray.

Each run_simulation costs about 10 s here (Ray start and stop), so these few tests
carry the whole path; everything else is tested in-process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments.report import table_rows
from experiments.runtime import PROJECT_ROOT
from experiments.simulate import simulate
from fedcomp.codecs.wire import HEADER_FIXED_BYTES
from fedcomp.models import build_model
from fedcomp.results_file import load_results
from fedcomp.settings import Settings, settings_from_dict

pytestmark = pytest.mark.simulation

SMALL = {"num_clients": 3, "num_rounds": 2, "seed": 3}


def _ray_processes() -> list[str]:
    """Ray processes this test session started: descendants of this process, or any
    process naming this session's Ray temp dir (other runs on the machine do not count)."""
    out = subprocess.run(
        ["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True
    )
    rows = [line.split(None, 2) for line in out.stdout.splitlines() if line.strip()]
    parent = {int(r[0]): int(r[1]) for r in rows}

    def ours(pid: int) -> bool:
        while pid > 1:
            pid = parent.get(pid, 1)
            if pid == os.getpid():
                return True
        return False

    ray_dir = os.environ.get("RAY_TMPDIR", "\0")
    tags = ("raylet", "gcs_server", "ray::", "default_worker.py")
    return [
        r[2]
        for r in rows
        if len(r) == 3 and any(tag in r[2] for tag in tags) and (ours(int(r[0])) or ray_dir in r[2])
    ]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Settings, dict, Path]:
    path = tmp_path_factory.mktemp("sim") / "results.json"
    settings = settings_from_dict({**SMALL, "results_path": str(path)})
    return settings, simulate(settings), path


def test_simulation_learns_writes_results_and_counts_real_bytes(first_run) -> None:
    settings, results, path = first_run
    assert load_results(path) == json.loads(json.dumps(results))
    summary = results["summary"]
    assert summary["final_accuracy"] > summary["initial_accuracy"] + 0.2
    model = build_model(settings.model, settings.dataset.name, settings.seed)
    fp32_packed = sum(
        HEADER_FIXED_BYTES + 4 * p.dim() + 4 * p.numel() for p in model.state_dict().values()
    )
    model_bytes = 4 * sum(p.numel() for p in model.state_dict().values())
    for rnd in results["rounds"]:
        assert (rnd["selected"], rnd["replied"], rnd["failures"]) == (3, 3, 0)
        for row in rnd["per_client"]:
            assert row["uplink_codec_bytes"] == fp32_packed == row["client_codec_bytes"]
            assert row["uplink_record_bytes"] > row["uplink_codec_bytes"]
            # The model dominates; Flower adds about 1.3 KB of objects per message.
            assert 0 < row["uplink_wire_bytes"] - row["uplink_codec_bytes"] < 4096
            assert 0 < row["downlink_wire_bytes"] - model_bytes < 8192
        assert rnd["uplink_wire_bytes"] == sum(r["uplink_wire_bytes"] for r in rnd["per_client"])
    assert summary["ratio_vs_fp32_codec"] == 1.0


def test_no_ray_process_is_left_behind(first_run) -> None:
    # Ray's processes exit on their own after shutdown: await that, with a generous
    # bound (a leaked raylet or worker lives on indefinitely).
    deadline = time.monotonic() + 120
    while _ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ray_processes() == [], "Ray processes still alive 120 s after the run"


def test_same_seed_gives_the_same_per_round_metrics(first_run) -> None:
    _settings, results, _ = first_run
    again = simulate(settings_from_dict({**SMALL}))
    keys = (
        "accuracy",
        "loss",
        "client_accuracy",
        "client_loss",
        "uplink_codec_bytes",
        "uplink_record_bytes",
        "replied",
    )
    for a, b in zip(results["rounds"], again["rounds"], strict=True):
        # Replies are decoded and summed in stable-id order, so this is bit-identical.
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


def test_multirun_writes_one_valid_results_file_per_run_and_report_matches(
    tmp_path: Path,
) -> None:
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "-m",
        "seed=0,1",  # two runs: Ray starts and stops twice in one process
        "partition.alpha=0.3",
        "num_rounds=1",
        "num_clients=3",
        f"hydra.sweep.dir={sweep}",
    ]
    subprocess.run(cmd, cwd=PROJECT_ROOT, check=True, capture_output=True, timeout=600)
    files = sorted(sweep.rglob("results.json"))
    assert len(files) == 2
    runs = [load_results(f) for f in files]
    assert sorted((r["config"]["seed"], r["config"]["partition"]["alpha"]) for r in runs) == [
        (0, 0.3),
        (1, 0.3),
    ]
    header, rows = table_rows(runs)
    assert header[:2] == ["seed", "final_accuracy"]  # only the swept key leads the table
    for run, row in zip(runs, rows, strict=True):
        assert row[header.index("final_accuracy")] == run["summary"]["final_accuracy"]
        assert row[header.index("uplink_wire_bytes")] == run["summary"]["uplink_wire_bytes_total"]
        assert row[header.index("wall_s")] == run["summary"]["wall_s"]
    out = subprocess.run(
        [sys.executable, "-m", "experiments.report", str(sweep)],
        cwd=PROJECT_ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("| seed | final_accuracy |") and len(lines) == 2 + 2


def _layout_bytes(spec: dict, shape: tuple[int, ...]) -> int:
    """Expected payload size of one tensor from the documented layouts and the policy."""
    n, header = math.prod(shape), 16 + 4 * len(shape)
    if n < 256:  # the default tensor policy: small tensors travel raw
        return header + 4 * n
    if spec["name"] == "uniform":
        return header + 6 + 4 * math.ceil(n / spec["block"]) + math.ceil(n * spec["bits"] / 8)
    if spec["name"] == "randk":
        return header + 8 + 4 * max(1, math.ceil(spec["fraction"] * n))
    raise AssertionError(spec)


@pytest.mark.parametrize(
    "spec",
    [
        pytest.param({"name": "uniform", "bits": 4, "block": 256}, id="uniform4"),
        # Under Ray as well as in-process (test_pipeline_inprocess): slow here.
        pytest.param({"name": "randk", "fraction": 0.05}, id="randk", marks=pytest.mark.slow),
    ],
)
def test_compressed_simulation_records_the_real_payload_sizes(spec: dict) -> None:
    settings = settings_from_dict({"num_clients": 3, "num_rounds": 3, "codec": spec})
    results = simulate(settings)
    model = build_model(settings.model, settings.dataset.name, settings.seed)
    expected = sum(_layout_bytes(spec, tuple(p.shape)) for p in model.state_dict().values())
    for rnd in results["rounds"]:
        assert (rnd["replied"], rnd["failures"]) == (3, 0)
        for row in rnd["per_client"]:
            assert row["uplink_codec_bytes"] == expected == row["client_codec_bytes"]
            assert row["uplink_wire_bytes"] > row["uplink_codec_bytes"]
    assert results["summary"]["ratio_vs_fp32_codec"] > 4
    assert results["summary"]["final_accuracy"] > results["summary"]["initial_accuracy"]


@pytest.mark.slow  # ~60 s; the multirun test above covers Hydra sweeps under Ray
def test_paired_report_and_plot_on_a_tiny_sweep(tmp_path: Path) -> None:
    """The residual experiment's smoke preset runs and its report matches its files."""
    sweep = tmp_path / "smoke"
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "-m",
        "+experiment=residual_digits_smoke",
        "num_rounds=2",
        f"hydra.sweep.dir={sweep}",
    ]
    subprocess.run(cmd, cwd=PROJECT_ROOT, check=True, capture_output=True, timeout=900)
    runs = [load_results(f) for f in sorted(sweep.rglob("results.json"))]
    assert len(runs) == 4
    plot = tmp_path / "acc.png"
    out = subprocess.run(
        [sys.executable, "-m", "experiments.report", "--paired", str(sweep), "--plot", str(plot)],
        cwd=PROJECT_ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    assert plot.exists() and plot.stat().st_size > 1000
    for codec in ("residual", "uniform"):
        finals = [
            r["summary"]["final_accuracy"] for r in runs if r["config"]["codec"]["name"] == codec
        ]
        assert f"| {codec} |" in out.stdout
        assert f"{sum(finals) / len(finals):.4f}" in out.stdout
    assert "Paired residual - direct" in out.stdout


@pytest.mark.slow
def test_the_main_job_reaches_ninety_percent() -> None:
    """`make run`'s default job, end to end: 10 rounds of FedAvg on 10 non-IID clients."""
    results = simulate(Settings())
    assert len(results["rounds"]) == 10
    assert results["summary"]["final_accuracy"] >= 0.9
    assert all(r["failures"] == 0 for r in results["rounds"])
