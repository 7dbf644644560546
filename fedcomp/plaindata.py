"""A tree of plain data as JSON plus named arrays, exactly and without pickle.

Checkpoints hold the strategy's state (dicts keyed by ints or strings, lists, tuples,
numbers including NaN and infinities, numpy arrays and numpy scalars, bytes). JSON alone
would turn int keys into strings, tuples into lists and numpy scalars into Python
numbers, and cannot hold arrays; pickle could hold all of it but runs code when loaded.
:func:`encode` splits a tree into a JSON-ready tree and a dict of arrays (for an
``.npz`` file loaded with ``allow_pickle=False``); :func:`decode` inverts it exactly.

Anything JSON cannot hold as itself becomes a one-key object whose key is a tag:

- ``{"__array__": "a3"}``: the array ``a3`` of the arrays dict (no object dtypes);
- ``{"__scalar__": "a4"}``: a numpy scalar, stored as the 0-d array ``a4``;
- ``{"__tuple__": [...]}``, ``{"__bytes__": "<base64>"}``;
- ``{"__float__": "nan" | "inf" | "-inf"}``: non-finite Python floats;
- ``{"__dict__": [[key, value], ...]}``: a dict with a key that is not a string (or a
  string key that is itself a tag), keys and values encoded alike.

Every other dict is a JSON object with the same string keys.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

ARRAY, SCALAR, TUPLE, BYTES, FLOAT, DICT = (
    "__array__",
    "__scalar__",
    "__tuple__",
    "__bytes__",
    "__float__",
    "__dict__",
)
TAGS = frozenset((ARRAY, SCALAR, TUPLE, BYTES, FLOAT, DICT))
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
ALLOWED = (
    "dict, list, tuple, str, int, float, bool, None, bytes, numpy arrays (no object "
    "dtype) and numpy scalars"
)


class PlainDataError(ValueError):
    """A value that is not plain data, or a stored tree that does not decode."""


def encode(tree: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """Split ``tree`` into a JSON-ready tree and the arrays it references.

    Raises
    ------
    PlainDataError
        Naming where in the tree a value of another type sits.
    """
    arrays: dict[str, np.ndarray] = {}
    return _encode(tree, arrays, "state"), arrays


def decode(tree: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """Rebuild what :func:`encode` split (raises PlainDataError on a malformed tree)."""
    return _decode(tree, arrays, "state")


def _store(value: np.ndarray | np.generic, arrays: dict[str, np.ndarray], where: str) -> str:
    if value.dtype.hasobject:  # an object array would need pickle to be stored
        raise PlainDataError(f"{where}: a numpy value of dtype {value.dtype} is not plain data")
    key = f"a{len(arrays)}"
    arrays[key] = np.asarray(value)
    return key


def _encode(value: Any, arrays: dict[str, np.ndarray], where: str) -> Any:
    # numpy scalars first: np.float64 is a float and np.bool_ is not a bool
    if isinstance(value, np.generic):
        return {SCALAR: _store(value, arrays, where)}
    if isinstance(value, np.ndarray):  # a memmap is stored as the array it maps
        return {ARRAY: _store(np.asarray(value), arrays, where)}
    # exact types: a subclass (an IntEnum, say) would come back as its base type
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {FLOAT: repr(value)}
    if type(value) is bytes:
        return {BYTES: base64.b64encode(value).decode("ascii")}
    if type(value) is list:
        return [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
    if type(value) is tuple:
        return {TUPLE: [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]}
    if type(value) is dict:
        return _encode_dict(value, arrays, where)
    raise PlainDataError(
        f"{where}: a {type(value).__name__} is not plain data (allowed: {ALLOWED})"
    )


def _encode_dict(value: dict, arrays: dict[str, np.ndarray], where: str) -> Any:
    if all(type(k) is str and k not in TAGS for k in value):
        return {k: _encode(v, arrays, f"{where}[{k!r}]") for k, v in value.items()}
    return {
        DICT: [
            [_encode(k, arrays, f"{where} key {k!r}"), _encode(v, arrays, f"{where}[{k!r}]")]
            for k, v in value.items()
        ]
    }


def _decode(value: Any, arrays: Mapping[str, np.ndarray], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, dict):
        return value
    if len(value) == 1 and next(iter(value)) in TAGS:
        ((tag, inner),) = value.items()
        return _decode_tagged(tag, inner, arrays, where)
    return {k: _decode(v, arrays, f"{where}[{k!r}]") for k, v in value.items()}


def _decode_tagged(tag: str, inner: Any, arrays: Mapping[str, np.ndarray], where: str) -> Any:
    if tag in (ARRAY, SCALAR):
        if not isinstance(inner, str) or inner not in arrays:
            raise PlainDataError(f"{where}: {tag} names {inner!r}, which the arrays lack")
        array = np.array(arrays[inner])  # a copy the caller owns
        return array[()] if tag == SCALAR else array
    if tag == FLOAT and inner in _NON_FINITE:
        return _NON_FINITE[inner]
    if tag == BYTES and isinstance(inner, str):
        return base64.b64decode(inner.encode("ascii"), validate=True)
    if tag == TUPLE and isinstance(inner, list):
        return tuple(_decode(v, arrays, f"{where}[{i}]") for i, v in enumerate(inner))
    if tag == DICT and isinstance(inner, list) and all(_is_pair(p) for p in inner):
        return {
            _hashable(_decode(k, arrays, f"{where} key"), where): _decode(
                v, arrays, f"{where}[{i}]"
            )
            for i, (k, v) in enumerate(inner)
        }
    raise PlainDataError(f"{where}: a malformed {tag} entry ({inner!r:.80})")


def _is_pair(item: Any) -> bool:
    return isinstance(item, list) and len(item) == 2


def _hashable(key: Any, where: str) -> Any:
    try:
        hash(key)
    except TypeError:
        raise PlainDataError(f"{where}: a dict key of type {type(key).__name__}") from None
    return key
