"""The checkpoint format (fedcomp.checkpoint, fedcomp.plaindata): JSON plus npz, no
pickle. A state round-trips exactly (int dict keys, tuples, NaN, numpy scalars and
their dtypes, arrays); an old pickle checkpoint is refused by name and never loaded."""

from __future__ import annotations

import json
import math
import os
import pickle

import numpy as np
import pytest
from flwr.app import ArrayRecord

from clients.client_app import make_client_app
from experiments.inprocess import InProcessGrid, set_task_identity
from fedcomp.checkpoint import Checkpoint, checkpoint_dir, load_checkpoint, save_checkpoint
from fedcomp.models import build_model
from fedcomp.plaindata import PlainDataError, decode, encode
from fedcomp.settings import settings_from_dict, settings_to_dict
from strategies.server_app import build_strategy


def assert_same(a, b, where="state"):
    """Equal values of exactly the same types (arrays: dtype, shape, NaNs in place)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"), where
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype, where
        assert a == b or (np.isnan(a) and np.isnan(b)), where
    elif isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b)), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where  # keys, their types and their order
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


TRICKY = {
    "accepted_round": {3: 2, 0: 1, -1: 7},
    "mixed": {1: "a", "1": "b", (2, "x"): [1.5]},
    "tuples": [(1, "a", {"w": b"\x00\xff"}, "c", {"s": 0.5})],
    "floats": [math.nan, math.inf, -math.inf, 0.1, -0.0],
    "scalars": [np.float32(1.1), np.float64(math.nan), np.int64(-3), np.bool_(True)],
    "arrays": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "e": np.zeros(0)},
    "zero_d": np.array(2.5),
    "tag_like": {"__array__": "not a reference", "__tuple__": 1},
    "nested": [[], {}, None, True, False, 2**70, ""],
}


def test_plaindata_round_trip_is_exact():
    tree, arrays = encode(TRICKY)
    assert all(isinstance(v, np.ndarray) and not v.dtype.hasobject for v in arrays.values())
    stored = json.loads(json.dumps(tree, allow_nan=False))  # strict JSON, as on disk
    assert_same(TRICKY, decode(stored, arrays))


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ({"a": [1, {2, 3}]}, r"state\['a'\]\[1\]: a set"),
        ({"x": np.array([object()], dtype=object)}, r"state\['x'\].*dtype object"),
        ({"f": lambda: 0}, r"state\['f'\]: a function"),
    ],
)
def test_plaindata_refuses_what_is_not_plain_naming_where(value, named):
    with pytest.raises(PlainDataError, match=named):
        encode(value)


def test_save_load_round_trip_and_layout(tmp_path):
    model = {"w": np.linspace(0, 1, 5, dtype=np.float32)}
    settings = {"seed": 0, "codec": {"name": "uniform", "bits": 4}, "hidden": [3, 4]}
    save_checkpoint(tmp_path, Checkpoint(round=1, arrays=model, strategy={}, settings={}))
    save_checkpoint(tmp_path, Checkpoint(2, model, dict(TRICKY), settings))
    names = sorted(p.name for p in checkpoint_dir(tmp_path).iterdir())
    assert names == ["model-00002.npz", "state-00002.npz", "state.json"]
    loaded = load_checkpoint(tmp_path)
    assert loaded.round == 2
    assert_same(model, loaded.arrays)
    assert_same(dict(TRICKY), loaded.strategy)
    assert_same(settings, loaded.settings)


def _real_state(settings_tree):
    """A strategy's state after two real rounds in process."""
    set_task_identity()
    settings = settings_from_dict(settings_tree)
    strategy = build_strategy(settings)
    model = build_model(settings.model, settings.dataset.name, settings.seed)
    grid = InProcessGrid(make_client_app(), settings.num_clients)
    strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=2)
    return strategy.state_dict(), settings_to_dict(settings)


def test_a_real_strategy_state_round_trips(tmp_path):
    """FedAdam's moments, residual mirrors, the downlink's replica and history."""
    state, settings = _real_state(
        {
            "num_clients": 3,
            "fraction_evaluate": 0.0,
            "train": {"local_epochs": 1},
            "codec": {"name": "residual", "inner": "uniform", "bits": 2, "block": 64},
            "downlink": {"name": "uniform", "bits": 8},
            "strategy": {"name": "fedadam"},
            "progress": "off",
        }
    )
    assert state["broadcast"] is not None and state["cv"]["mirrors"]  # what it tests
    save_checkpoint(tmp_path, Checkpoint(2, {"w": np.ones(2)}, state, settings))
    loaded = load_checkpoint(tmp_path)
    assert_same(state, loaded.strategy)
    assert_same(settings, loaded.settings)


class _Planted:
    """Unpickling this would create ``path``: the proof that a pickle was loaded."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_an_old_pickle_checkpoint_is_refused_and_never_loaded(tmp_path):
    marker = tmp_path / "pwned"
    folder = checkpoint_dir(tmp_path / "run")
    folder.mkdir(parents=True)
    (folder / "state.pkl").write_bytes(pickle.dumps({"round": 1, "x": _Planted(marker)}))
    np.savez(folder / "model-00001.npz", w=np.zeros(2))
    with pytest.raises(ValueError, match=r"state\.pkl.*old pickle format.*rerun"):
        load_checkpoint(tmp_path / "run")
    assert not marker.exists()
    # next to a valid state.json the pickle is ignored, still never loaded
    save_checkpoint(tmp_path / "run", Checkpoint(3, {"w": np.ones(1)}, {}, {}))
    assert load_checkpoint(tmp_path / "run").round == 3
    assert not marker.exists()


def test_a_pickled_array_inside_the_npz_is_refused(tmp_path):
    """An object array in state-*.npz needs pickle: np.load with allow_pickle=False
    refuses it before anything is built."""
    save_checkpoint(tmp_path, Checkpoint(1, {"w": np.ones(1)}, {"a": np.ones(2)}, {}))
    marker = tmp_path / "pwned"
    bad = np.array([_Planted(marker)], dtype=object)
    path = checkpoint_dir(tmp_path) / "state-00001.npz"
    os.remove(path)
    np.savez(path, a0=bad)  # np.savez pickles object arrays
    with pytest.raises(ValueError, match="allow_pickle"):
        load_checkpoint(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("not json", "is not JSON"),
        ('{"format": "other", "round": 1}', "has format 'other'"),
        ('{"format": "fedcomp-checkpoint-2", "round": "1"}', "names round '1'"),
        ('{"format": "fedcomp-checkpoint-2", "round": 1, "state": {"__array__": "z"}}', "lack"),
    ],
)
def test_a_malformed_state_file_is_refused_naming_it(tmp_path, text, named):
    save_checkpoint(tmp_path, Checkpoint(1, {"w": np.ones(1)}, {}, {}))
    (checkpoint_dir(tmp_path) / "state.json").write_text(text)
    with pytest.raises(ValueError, match=named) as info:
        load_checkpoint(tmp_path)
    assert "state.json" in str(info.value) or "format" in str(info.value)
