"""Explicit checkpoint state of the inner Flower strategies (Flower has no state API).

One small adapter per supported class names the attributes that change from round to
round; a checkpoint holds those attributes as plain arrays and numbers, never a pickled
Flower object, and a class without an adapter is refused by name instead of guessed.

Supported (exact classes; a subclass may add state, so it is refused too):
FedAvg, FedProx, FedMedian, FedTrimmedAvg (no state); FedAvgM (current arrays and the
momentum vector); FedAdam, FedYogi, FedAdagrad (current arrays, m_t, v_t); and Flower's
four DP clipping wrappers (their clipping norm and current arrays, plus the wrapped
strategy's state) when they run without a privacy accountant.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Strategy,
)

_DP = (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
)
#: The attributes that carry each supported class's state between rounds.
STATE_ATTRIBUTES: dict[type, tuple[str, ...]] = {
    FedAvg: (),
    FedProx: (),
    FedMedian: (),
    FedTrimmedAvg: (),
    FedAvgM: ("current_arrays", "momentum_vector"),
    FedAdam: ("current_arrays", "m_t", "v_t"),
    FedYogi: ("current_arrays", "m_t", "v_t"),
    FedAdagrad: ("current_arrays", "m_t", "v_t"),
    **dict.fromkeys(_DP, ("clipping_norm", "current_arrays")),
}


class UnsupportedStrategy(ValueError):
    """An inner strategy whose state no adapter knows: checkpoints refuse it."""


def _supported() -> str:
    return ", ".join(sorted(cls.__name__ for cls in STATE_ATTRIBUTES))


def _attributes(strategy: Strategy) -> tuple[str, ...]:
    cls = type(strategy)
    if cls not in STATE_ATTRIBUTES:
        raise UnsupportedStrategy(
            f"cannot checkpoint the inner strategy {cls.__name__}: its state is unknown to "
            f"fedcomp (supported: {_supported()})"
        )
    if isinstance(strategy, _DP) and getattr(strategy, "accountant", None) is not None:
        raise UnsupportedStrategy(
            f"cannot checkpoint {cls.__name__} with a privacy accountant: the accountant's "
            "state has no adapter; run without checkpoints or without the accountant"
        )
    return STATE_ATTRIBUTES[cls]


def _plain(value: Any) -> Any:
    """A copy of an attribute as plain data: arrays, numbers, lists, dicts, None."""
    if isinstance(value, ArrayRecord):
        return {"__arrayrecord__": {k: np.array(v.numpy()) for k, v in value.items()}}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.copy()
    if value is None or isinstance(value, bool | int | float | np.floating):
        return value
    raise UnsupportedStrategy(f"state attribute of type {type(value).__name__} is not plain")


def _restore(value: Any) -> Any:
    if isinstance(value, Mapping) and "__arrayrecord__" in value:
        return ArrayRecord({k: Array(np.array(v)) for k, v in value["__arrayrecord__"].items()})
    if isinstance(value, Mapping):
        return {k: _restore(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_restore(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


def inner_state_dict(strategy: Strategy) -> dict[str, Any]:
    """The inner strategy's state as plain data (raises UnsupportedStrategy)."""
    state = {"class": type(strategy).__name__}
    state.update({name: _plain(getattr(strategy, name)) for name in _attributes(strategy)})
    if isinstance(strategy, _DP):
        state["wrapped"] = inner_state_dict(strategy.strategy)
    return state


def load_inner_state_dict(strategy: Strategy, state: Mapping[str, Any]) -> None:
    """Put a saved state back into a freshly built strategy of the same class."""
    names = _attributes(strategy)
    if state.get("class") != type(strategy).__name__:
        raise UnsupportedStrategy(
            f"the checkpoint holds the state of {state.get('class')}, "
            f"the run builds {type(strategy).__name__}"
        )
    for name in names:
        setattr(strategy, name, _restore(state[name]))
    if isinstance(strategy, _DP):
        load_inner_state_dict(strategy.strategy, state["wrapped"])
