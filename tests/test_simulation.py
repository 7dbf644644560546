"""End-to-end proof on the real runtime: Flower's simulation engine with Ray.

Each run_simulation costs about 10 s here (Ray start and stop), so these few tests
carry the whole path; everything else is tested in-process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from experiments.report import table_rows
from experiments.runtime import PROJECT_ROOT
from experiments.simulate import simulate
from fedcomp.codecs import TensorPolicy, make_codec_from_spec
from fedcomp.models import build_model
from fedcomp.results_file import load_results
from fedcomp.settings import Settings, settings_from_dict
from tests.ray_processes import await_no_new_ray_processes, ray_processes

pytestmark = pytest.mark.simulation

SMALL = {"num_clients": 3, "num_rounds": 2, "seed": 3}


@pytest.fixture(scope="module", autouse=True)
def ray_before() -> Iterator[set[int]]:
    """The session's Ray processes before this module starts Ray (another module's may
    still be exiting: not this module's to check); after the module, every Ray process
    it started must be gone."""
    before = set(ray_processes())
    yield before
    left = await_no_new_ray_processes(before)
    assert left == [], f"Ray processes of test_simulation alive 120 s after it: {left}"


@pytest.fixture(scope="module")
def first_run(
    tmp_path_factory: pytest.TempPathFactory, ray_before: set[int]
) -> tuple[Settings, dict, Path]:
    path = tmp_path_factory.mktemp("sim") / "results.json"
    settings = settings_from_dict({**SMALL, "results_path": str(path)})
    return settings, simulate(settings), path


def test_simulation_learns_writes_results_and_counts_real_bytes(first_run) -> None:
    settings, results, path = first_run
    assert load_results(path) == json.loads(json.dumps(results))
    summary = results["summary"]
    assert summary["final_accuracy"] > summary["initial_accuracy"] + 0.2
    model = build_model(settings.model, settings.dataset.name, settings.seed)
    # each tensor a compact entry (protocol 4): one header byte, then its float32 values
    fp32_packed = sum(1 + 4 * p.numel() for p in model.state_dict().values())
    model_bytes = 4 * sum(p.numel() for p in model.state_dict().values())
    for rnd in results["rounds"]:
        assert (rnd["selected"], rnd["replied"], rnd["failures"]) == (3, 3, 0)
        for row in rnd["per_client"]:
            assert row["uplink_codec_bytes"] == fp32_packed
            assert row["uplink_record_bytes"] > row["uplink_codec_bytes"]
            # The model dominates; Flower adds about 1.3 KB of objects per message.
            assert 0 < row["uplink_wire_bytes"] - row["uplink_codec_bytes"] < 4096
            assert 0 < row["downlink_wire_bytes"] - model_bytes < 8192
        assert rnd["uplink_wire_bytes"] == sum(r["uplink_wire_bytes"] for r in rnd["per_client"])
    assert summary["ratio_vs_fp32_codec"] == 1.0


def test_no_ray_process_is_left_behind(first_run, ray_before) -> None:
    # Only processes that were not alive before this module started Ray: another
    # module's leftovers are that module's to check.
    left = await_no_new_ray_processes(ray_before)
    assert left == [], "Ray processes still alive 120 s after the run"


@pytest.fixture(scope="module")
def multirun(tmp_path_factory: pytest.TempPathFactory, ray_before: set[int]) -> Path:
    """``python -m experiments.run -m``: two jobs in one process (Ray starts and stops
    twice there); the second has first_run's settings (seed 3, 3 clients, 2 rounds)."""
    sweep = tmp_path_factory.mktemp("multirun") / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "-m",
        f"seed=4,{SMALL['seed']}",
        "partition.alpha=0.3",
        f"num_rounds={SMALL['num_rounds']}",
        f"num_clients={SMALL['num_clients']}",
        f"hydra.sweep.dir={sweep}",
    ]
    subprocess.run(cmd, cwd=PROJECT_ROOT, check=True, capture_output=True, timeout=600)
    return sweep


def test_same_seed_gives_the_same_per_round_metrics(first_run, multirun) -> None:
    """first_run (simulate, in this process) and the multirun's job with the same
    settings (composed by Hydra, in another process, after a first job there)."""
    _settings, results, _ = first_run
    runs = [load_results(f) for f in multirun.rglob("results.json")]
    (again,) = [r for r in runs if r["config"]["seed"] == SMALL["seed"]]
    # the same settings, whichever way they were given, but for where files go
    # (experiments.run puts them in the job's directory; with client_state=memory the
    # clients' state directory holds only copies, for a resumed run)
    differ = {
        k
        for k in results["config"].keys() | again["config"].keys()
        if results["config"].get(k) != again["config"].get(k)
    }
    assert differ <= {"results_path", "client_state_dir"}, differ
    assert again["config"]["client_state"] == "memory"
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


def test_multirun_writes_one_valid_results_file_per_run_and_report_matches(multirun) -> None:
    files = sorted(multirun.rglob("results.json"))
    assert len(files) == 2
    runs = [load_results(f) for f in files]
    assert sorted((r["config"]["seed"], r["config"]["partition"]["alpha"]) for r in runs) == [
        (SMALL["seed"], 0.3),
        (4, 0.3),
    ]
    header, rows = table_rows(runs)
    assert header[:2] == ["seed", "final_accuracy"]  # only the swept key leads the table
    for run, row in zip(runs, rows, strict=True):
        assert row[header.index("final_accuracy")] == run["summary"]["final_accuracy"]
        assert row[header.index("uplink_wire_bytes")] == run["summary"]["uplink_wire_bytes_total"]
        assert row[header.index("wall_s")] == run["summary"]["wall_s"]
    out = subprocess.run(
        [sys.executable, "-m", "experiments.report", str(multirun)],
        cwd=PROJECT_ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    lines = [line for line in out.stdout.strip().splitlines() if line.startswith("|")]
    assert lines[0].startswith("| seed | final_accuracy |") and len(lines) == 2 + 2
    # Simulations have object counts: their socket bytes are modelled, not measured.
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        assert cells["socket (model)"] != "n/a" and cells["socket (measured)"] == "n/a"
    assert "modelled from the run's fp32 reference" in out.stdout


def _layout_bytes(spec: dict, shape: tuple[int, ...]) -> int:
    """Expected size of one tensor's compact entry (fedcomp.compact: the payload's header
    is one byte) from the documented layouts and the policy."""
    n, header = math.prod(shape), 1
    # the default tensor policy: raw where the codec would not save its margin
    # (its own definition is tested in tests/test_tensor_policy.py)
    if TensorPolicy().travels_raw(True, shape, make_codec_from_spec(spec)):
        return header + 4 * n
    if spec["name"] == "uniform":
        return header + 6 + 4 * math.ceil(n / spec["block"]) + math.ceil(n * spec["bits"] / 8)
    if spec["name"] == "randk":
        return header + 8 + 4 * max(1, math.ceil(spec["fraction"] * n))
    raise AssertionError(spec)


@pytest.mark.parametrize(
    "spec",
    [
        # Under Ray as well as in-process (test_pipeline_inprocess, test_traffic): slow
        # here (make test keeps one Ray simulation of its own: first_run above).
        pytest.param(
            {"name": "uniform", "bits": 4, "block": 256}, id="uniform4", marks=pytest.mark.slow
        ),
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
            assert row["uplink_codec_bytes"] == expected
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
def test_the_main_job_reaches_the_fp32_baselines_accuracy_with_fewer_bytes() -> None:
    """`make run`'s job, end to end through Hydra and Ray: the recommended recipe on 10
    non-IID clients, against the same job under fp32 FedAvg."""
    import re

    from hydra import compose, initialize_config_dir

    from experiments.run import CONF_DIR, settings_from_cfg

    makefile = (PROJECT_ROOT / "Makefile").read_text()
    overrides = re.search(r"^RUN_ARGS \?= (.*)$", makefile, re.M).group(1).split()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        job = settings_from_cfg(compose(config_name="config", overrides=overrides))
    results = simulate(job)
    baseline = simulate(Settings(num_rounds=job.num_rounds))  # fp32 FedAvg
    assert all(r["failures"] == 0 for r in results["rounds"])
    assert results["summary"]["final_accuracy"] >= baseline["summary"]["final_accuracy"] - 0.01
    total = results["summary"]["total_wire_bytes"]
    assert baseline["summary"]["total_wire_bytes"] > 20 * total
