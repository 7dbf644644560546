"""The experiment presets on FEMNIST and CIFAR-10: every sweep composes and validates, each
smoke size runs 2 rounds on the fixtures (in-process, and one real Hydra + Ray multirun),
and the report's table and plots match the results files."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clients.client_app import make_client_app
from clients.paths import paths_of
from experiments.inprocess import InProcessGrid
from experiments.presets import compose_runs, preset_settings, run_inprocess, sweep_axes
from experiments.report import main as report_main
from experiments.run import CONF_DIR
from experiments.runtime import PROJECT_ROOT
from fedcomp.results_file import load_results
from fedcomp.settings import Settings, settings_from_dict, validate
from strategies.server_app import run_server

PRESETS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))
NEW_PRESETS = [p for p in PRESETS if "femnist" in p or "cifar10" in p]


def covering_combos(axes: dict[str, list[str]]) -> list[tuple[str, ...]]:
    """Overrides of runs of the sweep in which every swept value of every key occurs at
    least once: run i takes value ``i mod len(values)`` of each key, so
    ``max(len(values))`` runs compose every group option and value of the sweep, each
    next to non-first values of the other keys, without composing the whole product
    (each Hydra composition costs about a quarter of a second here)."""
    columns = [[f"{k}={v}" for v in values] for k, values in axes.items()]
    width = max(len(column) for column in columns)
    return [tuple(column[i % len(column)] for column in columns) for i in range(width)]


def test_presets_name_the_experiments_and_validate() -> None:
    assert {
        "residual_femnist",
        "residual_femnist_smoke",
        "residual_cifar10",
        "residual_cifar10_smoke",
        "trees_femnist",
        "trees_femnist_smoke",
    } <= set(NEW_PRESETS)
    expected_runs = {
        "residual_femnist": 7 * 5,
        "residual_cifar10": 7 * 5,
        "trees_femnist": 4 * 2 * 4 * 3,
        "residual_femnist_smoke": 3,
        "residual_cifar10_smoke": 3,
        "trees_femnist_smoke": 2 * 4,
        "bidirectional_digits": 2 * 3 * 12 * 3,
        "bidirectional_digits_smoke": 2 * 2,
        "leaderboard_digits": 21 * 3,
        "leaderboard_digits_smoke": 3,
        "cross_device_smoke": 1,
        "cross_device": 3 * 3,
    }
    swept: dict[str, list[Settings]] = {}
    for name, count in expected_runs.items():
        axes, _ = sweep_axes(name)
        assert math.prod(len(axis) for axis in axes.values()) == count, name
        combos = covering_combos(axes)
        assert {o for combo in combos for o in combo} == {
            f"{k}={v}" for k, values in axes.items() for v in values
        }, name
        assert len(combos) == max(len(values) for values in axes.values()), name
        swept[name] = compose_runs(name, [], combos)
        for s in swept[name]:
            validate(s)
            if "cross_device" in name:
                assert s.dataset.name == "synthetic"
            elif "digits" not in name:
                assert s.dataset.name == ("cifar10" if "cifar10" in name else "femnist")
    residual = swept["residual_femnist"]
    assert {s.codec["name"] for s in residual} == {"fp32", "uniform", "residual"}
    assert {s.codec.get("bits") for s in residual} == {None, 8, 4, 2}
    assert {s.num_clients for s in residual} == {16}
    assert {s.seed for s in residual} == {0, 1, 2, 3, 4}
    assert {s.partition.name for s in residual} == {"natural"}
    assert {s.model.name for s in residual} == {"cnn"}
    assert {s.model.hidden[2] for s in residual} == {2048}  # the LEAF CNN
    assert {s.partition.name for s in swept["residual_cifar10"]} == {"dirichlet"}
    trees = swept["trees_femnist"]
    assert sorted({s.num_clients for s in trees}) == [8, 16, 32, 64]
    assert {s.aggregation.tree for s in trees} == {"sequential", "balanced", "blocked", "adaptive"}
    assert {s.aggregation.handoff for s in trees} == {"pre_aggregated"}
    assert {s.aggregation.dtype for s in trees} == {"fp32", "bf16"}


def _bits_payloads(results: dict) -> list[int]:
    return [r["uplink_codec_bytes"] for r in results["rounds"]]


def test_residual_cifar10_smoke_runs_two_rounds_at_identical_bytes(data_fixtures) -> None:
    runs = preset_settings(
        "residual_cifar10_smoke", f"dataset.path={data_fixtures['cifar_pickle']}", "num_rounds=2"
    )
    by_codec = {}
    for s in runs:
        results = run_inprocess(s)
        assert len(results["rounds"]) == 2
        for rnd in results["rounds"]:
            assert (rnd["selected"], rnd["replied"], rnd["failures"]) == (16, 16, 0)
        by_codec[s.codec["name"]] = results
    # Direct and residual 2-bit send the same payload bytes; both 14x below fp32 here.
    assert _bits_payloads(by_codec["uniform"]) == _bits_payloads(by_codec["residual"])
    for name in ("uniform", "residual"):
        assert by_codec[name]["summary"]["ratio_vs_fp32_codec"] > 10
    assert by_codec["fp32"]["summary"]["ratio_vs_fp32_codec"] == 1.0
    # Round 2 codes residuals against round 1's control variates: the ratio is what
    # its definition says, of two positive mean squared norms.
    rec = by_codec["residual"]["rounds"][1]["codec"]
    assert rec["residual_norm2_mean"] > 0 and rec["delta_norm2_mean"] > 0
    assert rec["residual_over_delta"] == pytest.approx(
        rec["residual_norm2_mean"] / rec["delta_norm2_mean"], rel=1e-12
    )
    # the sums over the 16 clients that coded a residual (the bound's terms)
    for key in ("residual_norm2", "delta_norm2"):
        assert rec[f"{key}_sum"] == pytest.approx(16 * rec[f"{key}_mean"], rel=1e-12)


def test_trees_femnist_smoke_runs_two_rounds_through_each_tree(data_fixtures) -> None:
    runs = preset_settings(
        "trees_femnist_smoke", f"dataset.path={data_fixtures['femnist']}", "num_rounds=2"
    )
    seen = set()
    for s in runs:
        results = run_inprocess(s)
        for rnd in results["rounds"]:
            assert (rnd["replied"], rnd["failures"]) == (s.num_clients, 0)
            tree = rnd["codec"]["tree"]
            assert tree["overflow_chunks"] == 0
            assert math.isfinite(tree["mse_vs_fp64"]) and tree["mse_vs_fp64"] > 0  # bf16
            if s.aggregation.tree != "adaptive":
                assert set(tree["chosen"]) == {s.aggregation.tree}
        seen.add((s.num_clients, s.aggregation.tree))
    assert len(seen) == 8


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_report_of_the_femnist_smoke_sweep_matches_its_results(
    data_fixtures, tmp_path, capsys
) -> None:
    """residual_femnist_smoke over 2 seeds (8 writers to keep it quick), run in-process
    into a multirun layout; then the report: the PNGs exist and every number in its
    table is the value computed here from the results files."""
    sweep = tmp_path / "sweep"
    runs = preset_settings(
        "residual_femnist_smoke",
        f"dataset.path={data_fixtures['femnist']}",
        "num_rounds=2",
        "num_clients=8",
        "seed=0,1",
    )
    assert len(runs) == 6
    for i, s in enumerate(runs):
        s.results_path = str(sweep / str(i) / "results.json")
        run_inprocess(s)
    out_dir = tmp_path / "report"
    # The command's main in this process (test_simulation runs its `python -m` entry):
    # the same table and files, without starting a second Python.
    capsys.readouterr()
    assert report_main(["--paired", str(sweep), "--out-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    for png in (
        "accuracy_vs_total_wire_bytes.png",
        "accuracy_vs_uplink_codec_bytes.png",
        "accuracy_vs_uplink_wire_bytes.png",
    ):
        data = (out_dir / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert (out_dir / "report.md").read_text().startswith("# Summary over seeds")

    results = [load_results(p) for p in sorted(sweep.rglob("results.json"))]
    by_codec: dict[str, list[dict]] = {}
    for r in results:
        by_codec.setdefault(r["config"]["codec"]["name"], []).append(r)
    lines = [ln for ln in out.splitlines() if ln.startswith("|")]
    header = _cells(lines[0])
    assert header[:2] == ["codec.name", "codec.bits"]
    rows = {_cells(ln)[0]: _cells(ln) for ln in lines[2:] if not ln.startswith("| bits")}
    target = float(np.mean([r["summary"]["final_accuracy"] for r in by_codec["fp32"]])) - 0.01
    for name, members in by_codec.items():
        row = dict(zip(header, rows[name], strict=True))
        finals = [m["summary"]["final_accuracy"] for m in members]
        half = 12.706 * np.std(finals, ddof=1) / np.sqrt(2)  # t(0.975, 1 dof)
        codec = [np.cumsum([x["uplink_codec_bytes"] for x in m["rounds"]]) for m in members]
        wire = [np.cumsum([x["uplink_wire_bytes"] for x in m["rounds"]]) for m in members]
        total = [np.cumsum([x["total_wire_bytes"] for x in m["rounds"]]) for m in members]
        first = [
            next((i for i, x in enumerate(m["rounds"]) if x["accuracy"] >= target), None)
            for m in members
        ]
        hit = [i for i, f in enumerate(first) if f is not None]

        def to_target(cum: list[np.ndarray], first=first, hit=hit) -> str:
            return f"{np.median([cum[i][first[i]] for i in hit]) / 1e6:.2f}" if hit else "n/a"

        def mean(key: str, members=members) -> float:
            return float(np.mean([m["summary"][key] for m in members]))

        assert row["seeds"] == "2"
        assert row["final accuracy (95% CI)"] == f"{np.mean(finals):.4f} +- {half:.4f}"
        assert row["min..max"] == f"{min(finals):.4f}..{max(finals):.4f}"
        assert row["total MB"] == f"{mean('total_wire_bytes') / 1e6:.2f}"
        total_reached = f"{to_target(total)} ({len(hit)}/2)" if hit else "n/a (0/2)"
        assert row["total MB to FedAvg - 0.01 (seeds reaching)"] == total_reached
        assert row["total ratio vs fp32"] == f"{mean('total_ratio_vs_fp32'):.2f}x"
        assert row["uplink codec MB"] == f"{np.mean([c[-1] for c in codec]) / 1e6:.2f}"
        assert row["uplink wire MB"] == f"{mean('uplink_wire_bytes_total') / 1e6:.2f}"
        reached = f"{to_target(codec)} ({len(hit)}/2)" if hit else "n/a (0/2)"
        assert row["codec MB to FedAvg - 0.01 (seeds reaching)"] == reached
        assert row["wire MB to FedAvg - 0.01"] == to_target(wire)
        assert row["ratio vs fp32 codec"] == f"{mean('ratio_vs_fp32_codec'):.2f}x"
        assert row["ratio vs fp32 wire"] == f"{mean('ratio_vs_fp32_wire'):.2f}x"
        assert row["wall s"] == f"{mean('wall_s'):.1f}"
    diffs = [
        r["summary"]["final_accuracy"] - u["summary"]["final_accuracy"]
        for r, u in zip(
            sorted(by_codec["residual"], key=lambda x: x["config"]["seed"]),
            sorted(by_codec["uniform"], key=lambda x: x["config"]["seed"]),
            strict=True,
        )
    ]
    half = 12.706 * np.std(diffs, ddof=1) / np.sqrt(2)
    assert f"| 2 | 2 | {np.mean(diffs):+.4f} +- {half:.4f} |" in out  # paired by seed


@pytest.mark.slow  # ~20 s; the in-process smoke tests cover the preset's numbers
@pytest.mark.simulation
def test_femnist_smoke_preset_under_hydra_and_ray(data_fixtures, tmp_path: Path) -> None:
    """The preset as a user runs it (Hydra multirun, Ray simulation, 16 writers), one
    codec: the same per-round numbers as the in-process run of the same settings."""
    sweep = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "-m",
        "+experiment=residual_femnist_smoke",
        f"dataset.path={data_fixtures['femnist']}",
        "num_rounds=2",
        "codec=residual2",
        f"hydra.sweep.dir={sweep}",
    ]
    subprocess.run(cmd, cwd=PROJECT_ROOT, check=True, capture_output=True, timeout=900)
    (ray,) = [load_results(p) for p in sweep.rglob("results.json")]
    (settings,) = preset_settings(
        "residual_femnist_smoke",
        f"dataset.path={data_fixtures['femnist']}",
        "num_rounds=2",
        "codec=residual2",
    )
    local = run_inprocess(settings)
    keys = ("accuracy", "loss", "uplink_codec_bytes", "replied", "failures")
    for a, b in zip(ray["rounds"], local["rounds"], strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
        assert a["replied"] == 16
    assert ray["summary"]["ratio_vs_fp32_codec"] > 10


@pytest.mark.slow
def test_cifar_resnet18_round_keeps_batchnorm_counters_exact(data_fixtures) -> None:
    """Two rounds of ResNet-18 (11.2M parameters) with 8-bit payloads: the int64
    num_batches_tracked buffers travel raw and average to the exact count."""
    s = settings_from_dict(
        {
            "num_clients": 2,
            "num_rounds": 2,
            "dataset": {"name": "cifar10", "path": str(data_fixtures["cifar_pickle"])},
            "partition": {"name": "iid"},
            "model": {"name": "resnet18", "hidden": []},
            "codec": {"name": "uniform", "bits": 8, "block": 256},
            "train": {"local_epochs": 1, "batch_size": 16},
        }
    )
    grid = InProcessGrid(make_client_app(paths=paths_of(s)), 2, node_ids=[1, 2])
    results = run_server(grid, s)
    assert all((r["replied"], r["failures"]) == (2, 0) for r in results["rounds"])
    per_tensor = results["rounds"][0]["codec"]["per_tensor"]
    assert per_tensor["layer4.1.bn2.num_batches_tracked"] == "raw"
    assert per_tensor["layer4.1.bn2.running_var"] == "uniform"  # 512 values: compressed
    # Each client holds 100 rows, 80 for training: 5 batches of 16 in round 1, so the
    # weighted mean of the counters in the model sent for round 2 is exactly 5. (In the
    # per-client hand-off Flower's FedAvg returns it as float64; clients load it back
    # into their int64 buffer.)
    round2 = [m for m in grid.sent if m.metadata.group_id == "2" and m.content.array_records]
    arrays = next(iter(round2[0].content.array_records.values())).to_torch_state_dict()
    assert float(arrays["bn1.num_batches_tracked"]) == 5.0


def test_onebit_cifar10_smoke_runs_two_rounds_with_the_exact_mean_measured(
    data_fixtures, tmp_path
) -> None:
    """Preset (2): heavy-tailed updates, equal ~1 bit per coordinate; every round records
    the aggregate's error against the clients' exact mean (fp32: rounding only)."""
    axes, _ = sweep_axes("onebit_cifar10")
    assert math.prod(len(values) for values in axes.values()) == 5 * 2 * 3
    full = compose_runs("onebit_cifar10", ["diagnostics_dir="], covering_combos(axes))
    assert {s.codec["name"] for s in full} == {"fp32", "dither", "sign", "qsgd", "onebit"}
    runs = preset_settings(
        "onebit_cifar10_smoke",
        f"dataset.path={data_fixtures['cifar_pickle']}",
        "num_rounds=2",
        "diagnostics_dir=",
    )
    for i, s in enumerate(runs):
        s.diagnostics_dir = str(tmp_path / f"diag{i}")
        results = run_inprocess(s)
        for rnd in results["rounds"]:
            assert (rnd["replied"], rnd["failures"]) == (8, 0)
            diag = rnd["diagnostics"]
            # the relative error is what its definition says (mse / power, both > 0)
            assert diag["update_power"] > 0
            assert diag["update_rel_mse"] == pytest.approx(
                diag["update_mse"] / diag["update_power"], rel=1e-12
            )
            if s.codec["name"] == "fp32":
                assert diag["update_rel_mse"] < 1e-10
            else:
                assert 0 < diag["update_mse"] and math.isfinite(diag["update_mse"])
        if s.codec["name"] == "onebit":
            assert results["rounds"][0]["codec"]["joint"]["joint_replied"] == 8


def test_bidirectional_digits_smoke_cuts_the_total_with_the_downlink() -> None:
    """fp32 both ways, the uplink alone, and 2-bit up with 4-bit down at a quarter of
    the clients: compressing the downlink cuts the TOTAL bytes well beyond what the
    uplink alone can, and the fp32 references are the same schedule's."""
    runs = {
        (s.codec["name"], s.downlink["name"]): s
        for s in preset_settings("bidirectional_digits_smoke")
    }
    assert set(runs) == {
        ("fp32", "fp32"),
        ("uniform", "fp32"),
        ("fp32", "uniform"),
        ("uniform", "uniform"),
    }
    results = {key: run_inprocess(s) for key, s in runs.items()}
    ratio = {key: r["summary"]["total_ratio_vs_fp32"] for key, r in results.items()}
    # fp32 both ways against plain Flower: its replies are one record each, not an
    # Array and a chunk per tensor (a few objects' framing on 400 KB messages)
    assert 1.0 < ratio[("fp32", "fp32")] < 1.01
    uplink_only = ratio[("uniform", "fp32")]
    both = ratio[("uniform", "uniform")]
    # Train replies are at most a third of fp32 FedAvg's traffic here, so the uplink
    # alone stays under 1.5x; both ways beat it in every round (the clients build the
    # initial model from the seed: no round sends the full model).
    assert 1.0 < uplink_only < 1.5 < 2 * uplink_only < both
    per_round = [
        r["fp32_total_wire_bytes"] / r["total_wire_bytes"]
        for r in results[("uniform", "uniform")]["rounds"]
    ]
    assert min(per_round) > 2 * uplink_only
    fp32 = results[("fp32", "fp32")]["summary"]["fp32_total_wire_bytes"]
    for key, r in results.items():
        # Each run's fp32 reference is what fp32 FedAvg really sent on the same
        # schedule, up to per-message metadata and the replica fields of fedcomp's
        # reply headers (under 100 bytes per message; 0.04% here).
        messages = sum(c["messages"] for rnd in r["rounds"] for c in rnd["traffic"].values())
        assert abs(r["summary"]["fp32_total_wire_bytes"] - fp32) <= 96 * messages, key
        assert all(rnd["replied"] == rnd["selected"] for rnd in r["rounds"]), key


def test_leaderboard_smoke_ranks_recipes_by_measured_total_bytes_to_fedavg_accuracy() -> None:
    """The leaderboard's smoke twin, in-process: every recipe runs, and each entry's
    bytes to the target are the cumulative measured totals at the first round reaching
    FedAvg's final accuracy minus one point (recomputed here from the rounds)."""
    from experiments.leaderboard import leaderboard, rank_recipes

    runs = [run_inprocess(s) for s in preset_settings("leaderboard_digits_smoke")]
    entries = rank_recipes(runs)
    assert len(entries) == 3 and sum(e["fedavg"] for e in entries) == 1
    fedavg = next(r for r in runs if r["config"]["codec"]["name"] == "fp32")
    target = fedavg["summary"]["final_accuracy"] - 0.01
    for entry in entries:
        (run,) = entry["members"]
        spent, expected = 0, None
        for rnd in run["rounds"]:
            spent += rnd["total_wire_bytes"]
            if rnd["accuracy"] >= target:
                expected = spent
                break
        assert entry["total_to_target"] == expected, entry["recipe"]
        assert entry["reached"] == (expected is not None)
    reached = [e for e in entries if e["reached"]]
    assert [e["total_to_target"] for e in reached] == sorted(e["total_to_target"] for e in reached)
    assert next(e for e in entries if e["fedavg"])["total_ratio"] == 1.0
    text = leaderboard(runs)
    assert "(FedAvg)" in text and "x fewer total bytes" in text


def test_report_selects_runs_by_setting() -> None:
    from experiments.report import select

    runs = [
        {"config": {"fraction_train": f, "codec": {"name": c}}}
        for f in (1.0, 0.25)
        for c in ("fp32", "uniform")
    ]
    assert select(runs, []) == runs
    assert select(runs, ["fraction_train=0.25"]) == runs[2:]
    kept = select(runs, ["fraction_train=0.25,1.0", "codec.name=uniform"])
    assert kept == [runs[1], runs[3]]
    with pytest.raises(FileNotFoundError, match=r"codec\.name=nope"):
        select(runs, ["codec.name=nope"])


def _state_bytes(state) -> int:
    return sum(
        len(array.data) for record in state.array_records.values() for array in record.values()
    )


def test_cross_device_smoke_learns_ids_once_and_keeps_state_only_where_clients_trained() -> None:
    """1,000 virtual clients, 20 a round: identity discovery is exactly one message each
    way per node, in round 1 only; every sampled client replies; and Context.state
    (held by the driver process in simulation) grows only for clients that were sampled.
    """
    (settings,) = preset_settings("cross_device_smoke")
    assert settings.num_clients == 1000
    ids = [10_000 + i for i in range(settings.num_clients)]  # random-looking, as Flower's
    grid = InProcessGrid(make_client_app(), settings.num_clients, node_ids=ids)
    results = run_server(grid, settings)
    first, *later = results["rounds"]
    assert first["traffic"]["identity_query"]["messages"] == 1000
    assert first["traffic"]["identity_reply"]["messages"] == 1000
    assert all("identity_query" not in r["traffic"] for r in later)
    assert [(r["selected"], r["replied"]) for r in results["rounds"]] == [(20, 20)] * 3
    # clients sent a round's train or evaluate instruction (not the identity message)
    reached = {
        grid.partition_of(m.metadata.dst_node_id)
        for m in grid.sent
        if m.metadata.group_id.isdigit()
    }
    sizes = {grid.partition_of(n): _state_bytes(c.state) for n, c in grid.contexts.items()}
    assert 20 <= len(reached) <= 3 * (20 + 10)
    assert all(sizes[sid] > 0 for sid in reached)
    assert all(size == 0 for sid, size in sizes.items() if sid not in reached)


def _round_numbers(results: dict) -> list[tuple]:
    """What a run computed and what its clients sent (instructions carry the settings,
    whose text differs between the runs compared)."""
    keys = ("accuracy", "loss", "client_accuracy", "uplink_wire_bytes", "resyncs", "replied")
    return [
        (*(r[k] for k in keys), r["traffic"]["train_reply"], r["traffic"]["evaluate_reply"])
        for r in results["rounds"]
    ]


def test_client_state_on_disk_keeps_context_state_empty_and_changes_nothing(tmp_path) -> None:
    """client_state=disk: the codec memory (error feedback) and the downlink replica
    live only in client_state_dir, so the driver's Context.state holds no arrays, and
    every per-round number equals the in-memory run's: clients sampled again read the
    same state back from their files, and a second run in the same directory ignores
    the first run's files (the server has accepted nothing from those clients yet)."""
    # 20 clients of 100 samples (10 train and 5 evaluate a round): what is compared is
    # the runs' numbers, and some clients train twice, some never
    sizes = (
        "num_clients=20",
        "dataset.num_samples=2000",
        "fraction_train=0.5",
        "fraction_evaluate=0.25",
        "num_rounds=3",
    )
    (memory,) = preset_settings("cross_device_smoke", *sizes)
    (disk,) = preset_settings(
        "cross_device_smoke", *sizes, "client_state=disk", f"client_state_dir={tmp_path}"
    )
    runs = {}
    # "again": the same run once more in the same directory, which now holds the first
    # run's memories and replicas: a new run must not pick them up
    for name, settings in (("memory", memory), ("disk", disk), ("again", disk)):
        ids = [10_000 + i for i in range(settings.num_clients)]
        client = make_client_app(paths=paths_of(settings))
        grid = InProcessGrid(client, settings.num_clients, node_ids=ids)
        runs[name] = (run_server(grid, settings), grid)
    (in_memory, grid_memory), (on_disk, grid_disk) = runs["memory"], runs["disk"]
    assert _round_numbers(on_disk) == _round_numbers(in_memory)
    assert _round_numbers(runs["again"][0]) == _round_numbers(in_memory)
    trained = [
        {c["client"] for c in r["per_client"] if "train_reply" in c["wire_bytes_by_kind"]}
        for r in in_memory["rounds"]
    ]
    assert trained[0] & trained[1]  # some clients trained again: their state was read
    assert len(set().union(*trained)) < 20  # and some never: the run has both kinds
    assert sum(_state_bytes(c.state) for c in grid_memory.contexts.values()) > 0
    assert all(_state_bytes(c.state) == 0 for c in grid_disk.contexts.values())
    names = {p.name for p in tmp_path.iterdir()}
    assert {f"client-{int(sid):06d}.npz" for sid in set().union(*trained)} <= names


def test_client_state_disk_needs_a_directory() -> None:
    with pytest.raises(ValueError, match=r"client_state.*client_state_dir"):
        preset_settings("cross_device_smoke", "client_state=disk")
    with pytest.raises(ValueError, match=r"client_state.*allowed: memory, disk"):
        preset_settings("cross_device_smoke", "client_state=ram")


def test_a_preset_with_a_bad_setting_fails_in_one_line_before_any_run(capsys, tmp_path) -> None:
    """The sweep tool, like experiments.run, refuses a bad setting before anything runs,
    in one line naming the key, the value and what is allowed."""
    from experiments.presets import main

    out = tmp_path / "sweep"
    assert main(["leaderboard_digits_smoke", "train.lr=0.0", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: invalid setting train.lr=0.0: must be > 0"
    assert not out.exists()


def test_the_sweep_tool_takes_hydras_override_grammar_or_refuses_it_in_one_line(
    capsys, tmp_path
) -> None:
    """Issue 41, finding 9: every override was split on '=', so Hydra's delete syntax
    failed with 'not enough values to unpack'. Delete, add and force-add now compose as
    Hydra composes them; what Hydra refuses is one line."""
    from experiments.presets import main

    (run,) = preset_settings("leaderboard_digits_smoke", "recipe=uniform4", "seed=0")
    assert run.codec.get("block") is not None
    (run,) = preset_settings(
        "leaderboard_digits_smoke", "recipe=uniform4", "seed=0", "~codec.block"
    )
    assert "block" not in run.codec
    (run,) = preset_settings(
        "leaderboard_digits_smoke", "recipe=uniform4", "seed=0", "++codec.bits=3"
    )
    assert run.codec["bits"] == 3
    for bad in ("a==b=c", "~codec.nothing"):
        assert main(["leaderboard_digits_smoke", bad, "--out-dir", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err


def test_a_codec_spec_is_checked_against_the_codecs_parameters_before_any_run(
    capsys, tmp_path
) -> None:
    from experiments.presets import main

    out = tmp_path / "sweep"
    args = ["codec=residual", "codec.inner=randk", "+codec.fraction=0.1"]
    assert main(["leaderboard_digits_smoke", "recipe=none", *args, "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: invalid setting codec=") and "does not take" in err
    assert "\n" not in err and not out.exists()


def test_a_run_that_fails_in_a_sweep_fails_that_run_only(monkeypatch, capsys, tmp_path) -> None:
    """Any exception in one run of a sweep (not only RunFailed) is that run's: the
    sweep goes on, and ends with status 1 naming how many failed."""
    import experiments.presets as presets

    calls = []

    def flaky(settings):
        calls.append(settings.seed)
        if len(calls) == 1:
            raise KeyError("a bug in one run")
        return {
            "summary": {
                "final_accuracy": 0.5,
                "best_accuracy": 0.5,
                "total_wire_bytes": 1,
                "total_ratio_vs_fp32": 1.0,
            }
        }

    monkeypatch.setattr(presets, "run_inprocess", flaky)
    out = tmp_path / "sweep"
    code = presets.main(
        ["leaderboard_digits_smoke", "recipe=fedavg", "seed=0,1", "--out-dir", str(out)]
    )
    printed = capsys.readouterr().out
    assert code == 1 and len(calls) > 1
    assert "FAILED: KeyError" in printed and f"1 of {len(calls)} runs failed" in printed
