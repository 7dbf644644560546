"""Whole-run checkpoint and resume (fedcomp.checkpoint, ``resume=<run dir>``), through
run_server on the in-process grid: a stopped and resumed run ends exactly where the
uninterrupted run does; without the clients' states, stateful codecs resync."""

from __future__ import annotations

import json

import numpy as np
import pytest

from clients.client_app import make_client_app
from clients.paths import paths_of
from experiments.inprocess import InProcessGrid, set_task_identity
from fedcomp.checkpoint import load_checkpoint
from fedcomp.settings import settings_from_dict
from strategies.server_app import run_server

N = 4


def _run(
    tmp_path,
    name,
    *,
    rounds,
    codec,
    resume="",
    strategy="fedadam",
    client_state=False,
    downlink=None,
):
    set_task_identity()
    run_dir = tmp_path / name
    run_dir.mkdir()
    settings = settings_from_dict(
        {
            "num_clients": N,
            "num_rounds": rounds,
            "fraction_evaluate": 0.0,
            "codec": codec,
            "strategy": {"name": strategy},
            "train": {"local_epochs": 1},
            "results_path": str(run_dir / "results.json"),
            "resume": resume,
            "progress": "off",
            "client_state_dir": str(run_dir / "client_state") if client_state else "",
            **({"downlink": downlink} if downlink else {}),
        }
    )
    results = run_server(InProcessGrid(make_client_app(paths=paths_of(settings)), N), settings)
    return results, load_checkpoint(run_dir)


def test_resume_equals_the_uninterrupted_run(tmp_path):
    codec = {"name": "uniform", "bits": 4}
    full, full_ckpt = _run(tmp_path, "full", rounds=4, codec=codec)
    _, stopped = _run(tmp_path, "stopped", rounds=2, codec=codec)
    assert stopped.round == 2
    resumed, resumed_ckpt = _run(
        tmp_path, "resumed", rounds=4, codec=codec, resume=str(tmp_path / "stopped")
    )
    assert [r["round"] for r in resumed["rounds"]] == [1, 2, 3, 4]
    for a, b in zip(full["rounds"], resumed["rounds"], strict=True):
        assert (a["accuracy"], a["loss"], a["uplink_codec_bytes"]) == (
            b["accuracy"],
            b["loss"],
            b["uplink_codec_bytes"],
        )
    assert resumed_ckpt.round == 4
    for name, value in full_ckpt.arrays.items():
        assert np.array_equal(value, resumed_ckpt.arrays[name]), name


def test_resume_without_client_state_resyncs_and_carries_on(tmp_path):
    codec = {"name": "residual", "inner": "uniform", "bits": 2, "block": 64}
    _run(tmp_path, "stopped", rounds=2, codec=codec, strategy="fedavg")
    resumed, _ = _run(
        tmp_path,
        "resumed",
        rounds=3,
        codec=codec,
        strategy="fedavg",
        resume=str(tmp_path / "stopped"),
    )
    last = resumed["rounds"][-1]
    assert last["round"] == 3 and last["replied"] == N
    # new client processes: no control variates, so every client restarts from h = 0
    assert last["codec"]["restarts"] == N


def test_resume_refuses_a_different_run_or_a_finished_one(tmp_path):
    codec = {"name": "uniform", "bits": 4}
    _run(tmp_path, "stopped", rounds=2, codec=codec)
    with pytest.raises(ValueError, match="codec"):
        _run(tmp_path, "other", rounds=4, codec={"name": "fp32"}, resume=str(tmp_path / "stopped"))
    with pytest.raises(ValueError, match="already finished round 2"):
        _run(tmp_path, "again", rounds=2, codec=codec, resume=str(tmp_path / "stopped"))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        _run(tmp_path, "nothing", rounds=2, codec=codec, resume=str(tmp_path / "missing"))


def test_resume_with_client_states_equals_the_uninterrupted_residual_run(tmp_path):
    """With the clients' codec memories on disk (client_state_dir, what experiments.run
    sets), a stopped residual run resumes in NEW client processes (fresh contexts) and
    ends bit for bit where the uninterrupted run does: no restart, no resync."""
    codec = {"name": "residual", "inner": "uniform", "bits": 2, "block": 64}
    full, full_ckpt = _run(
        tmp_path, "full", rounds=4, codec=codec, strategy="fedavg", client_state=True
    )
    _run(tmp_path, "stopped", rounds=2, codec=codec, strategy="fedavg", client_state=True)
    resumed, resumed_ckpt = _run(
        tmp_path,
        "resumed",
        rounds=4,
        codec=codec,
        strategy="fedavg",
        client_state=True,
        resume=str(tmp_path / "stopped"),
    )
    assert [r["codec"]["restarts"] for r in resumed["rounds"]][2:] == [0, 0]
    for a, b in zip(full["rounds"], resumed["rounds"], strict=True):
        assert (a["accuracy"], a["loss"]) == (b["accuracy"], b["loss"])
    for name, value in full_ckpt.arrays.items():
        assert np.array_equal(value, resumed_ckpt.arrays[name]), name


def test_resume_with_client_states_sends_what_the_uninterrupted_run_sends(tmp_path):
    """A downlink replica and a residual memory kept in client_state_dir: the resumed run
    sends the same bytes in every round as the uninterrupted one (no full model after
    the resume: the server keeps what each client holds) and learns the same model."""
    codec = {"name": "residual", "inner": "uniform", "bits": 2, "block": 64}

    def run(name, rounds, resume=""):
        return _run(
            tmp_path,
            name,
            rounds=rounds,
            codec=codec,
            strategy="fedavg",
            client_state=True,
            resume=resume,
            downlink={"name": "uniform", "bits": 2, "block": 64},
        )

    full, full_ckpt = run("full", 4)
    run("stopped", 2)
    resumed, resumed_ckpt = run("resumed", 4, resume=str(tmp_path / "stopped"))
    model_bytes = sum(v.nbytes for v in full_ckpt.arrays.values())
    for a, b in zip(full["rounds"], resumed["rounds"], strict=True):
        assert a["accuracy"] == b["accuracy"], a["round"]
        if a["round"] != 3:
            assert a["total_wire_bytes"] == b["total_wire_bytes"], a["round"]
    # Round 3, the first after the resume: the clients' contexts are new, so each is
    # sent the run settings once more (under a kilobyte), never the model (x_hat).
    excess = resumed["rounds"][2]["total_wire_bytes"] - full["rounds"][2]["total_wire_bytes"]
    assert 0 <= excess < 0.01 * N * model_bytes
    for name, value in full_ckpt.arrays.items():
        assert np.array_equal(value, resumed_ckpt.arrays[name]), name


def test_resume_without_client_states_sends_the_replica_in_full(tmp_path):
    """Without the clients' states (new client processes, no state directory) the
    first instruction after the resume carries each client's replica in full."""
    common = {"codec": {"name": "uniform", "bits": 4}, "strategy": "fedavg"}
    down = {"name": "uniform", "bits": 2, "block": 64}
    full, _ = _run(tmp_path, "full", rounds=3, downlink=down, **common)
    _run(tmp_path, "stopped", rounds=2, downlink=down, **common)
    resumed, _ = _run(
        tmp_path, "resumed", rounds=3, downlink=down, resume=str(tmp_path / "stopped"), **common
    )
    assert (
        resumed["rounds"][2]["downlink_wire_bytes"] > 3 * full["rounds"][2]["downlink_wire_bytes"]
    )
    assert resumed["rounds"][2]["accuracy"] == full["rounds"][2]["accuracy"]


# --- issue 41, finding 10: a malformed checkpoint is refused in one line -------------


def _stopped(tmp_path):
    codec = {"name": "uniform", "bits": 4}
    _run(tmp_path, "stopped", rounds=2, codec=codec, client_state=True)
    return tmp_path / "stopped" / "checkpoint", codec


def _refused(tmp_path, codec, match):
    with pytest.raises(ValueError, match=match) as info:
        _run(tmp_path, "resumed", rounds=4, codec=codec, resume=str(tmp_path / "stopped"))
    assert "\n" not in str(info.value)  # one line
    return str(info.value)


def test_a_deeply_nested_state_file_is_refused_naming_it(tmp_path):
    folder, codec = _stopped(tmp_path)
    (folder / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "state.json" in _refused(tmp_path, codec, "is not JSON|malformed")


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["state"]["strategy"].pop("rounds"),
        lambda s: s["state"]["strategy"].__setitem__("rounds", 5),
        lambda s: s["state"]["strategy"].__setitem__("accepted_round", "nothing"),
        lambda s: s["state"]["strategy"].__setitem__("strikes", "x"),
        lambda s: s["state"].pop("settings"),
    ],
    ids=["missing-key", "wrong-type", "not-a-mapping", "bad-strikes", "no-settings"],
)
def test_a_state_file_with_a_missing_key_or_a_wrong_type_is_refused_naming_it(tmp_path, change):
    folder, codec = _stopped(tmp_path)
    state = json.loads((folder / "state.json").read_text())
    change(state)
    (folder / "state.json").write_text(json.dumps(state))
    assert "state.json" in _refused(tmp_path, codec, "state.json")


def test_a_model_of_another_shape_is_refused_naming_its_file(tmp_path):
    folder, codec = _stopped(tmp_path)
    (model,) = folder.glob("model-*.npz")
    with np.load(model) as data:
        arrays = {k: data[k] for k in data.files}
    name = next(iter(arrays))
    arrays[name] = np.zeros((3, 3), arrays[name].dtype)
    np.savez(model, **arrays)
    assert model.name in _refused(tmp_path, codec, rf"tensor '{name}' is float32\[3, 3\]")


def test_resume_copies_client_state_only_from_the_stopped_runs_own_directory(tmp_path):
    """The client_state_dir a state file names is never read: a file pointing it at
    another directory copies nothing from there."""
    codec = {"name": "residual", "inner": "uniform", "bits": 2, "block": 64}
    _run(tmp_path, "stopped", rounds=2, codec=codec, strategy="fedavg", client_state=True)
    folder = tmp_path / "stopped" / "checkpoint"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.npz").write_bytes(b"not the run's")
    state = json.loads((folder / "state.json").read_text())
    state["state"]["settings"]["client_state_dir"] = str(elsewhere)
    (folder / "state.json").write_text(json.dumps(state))
    _run(
        tmp_path,
        "resumed",
        rounds=3,
        codec=codec,
        strategy="fedavg",
        resume=str(tmp_path / "stopped"),
        client_state=True,
    )
    copied = {p.name for p in (tmp_path / "resumed" / "client_state").iterdir()}
    own = {p.name for p in (tmp_path / "stopped" / "client_state").iterdir()}
    assert "secret.npz" not in copied and own <= copied
