"""Codecs with real packed payloads.

Public API::

    from fedcomp.codecs import make_codec, decode_bytes
    codec = make_codec("fp32")
    payload = codec.encode(x, seed=seed)      # bytes(payload) is the whole buffer
    y = codec.decode(payload)                 # same shape and dtype as x
    y = decode_bytes(bytes(payload))          # no other context needed

``make_codec(name, **params)`` is the one factory (Hydra calls it through
``make_codec_from_spec``). Unknown names or parameters raise ``ValueError``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from fedcomp.codecs import adaptive as _adaptive  # noqa: F401  (adaptive)
from fedcomp.codecs import dense as _dense  # noqa: F401  (registers raw, fp32, fp16, bf16)
from fedcomp.codecs import eden as _eden  # noqa: F401  (eden)
from fedcomp.codecs import entropy as _entropy  # noqa: F401  (the lossless stage)
from fedcomp.codecs import lowrank as _lowrank  # noqa: F401  (lowrank)
from fedcomp.codecs import quantizers as _quantizers  # noqa: F401  (uniform, qsgd, sign)
from fedcomp.codecs import rotated as _rotated  # noqa: F401  (rotate)
from fedcomp.codecs import sketch as _sketch  # noqa: F401  (sketch)
from fedcomp.codecs import sparse as _sparse  # noqa: F401  (topk, randk)
from fedcomp.codecs import sparse_quantized as _sparseq  # noqa: F401  (sparseq)
from fedcomp.codecs import subsample as _subsample  # noqa: F401  (subsample)
from fedcomp.codecs.base import (
    Codec,
    codec_class,
    codec_class_by_id,
    codec_names,
    decode_bytes,
)
from fedcomp.codecs.dgc import DGCMemory
from fedcomp.codecs.ef21 import EF21Memory
from fedcomp.codecs.entropy import DEFAULT_LEVEL, EntropyCodec
from fedcomp.codecs.lowrank import PowerSGDMemory
from fedcomp.codecs.memory import ErrorFeedback, Memory
from fedcomp.codecs.policy import TensorPolicy
from fedcomp.codecs.residual import ResidualMemory
from fedcomp.codecs.rotated import RotatedCodec
from fedcomp.codecs.subsample import SubsampledCodec
from fedcomp.codecs.wire import Payload, PayloadError, PayloadHeader, parse_payload
from fedcomp.rules import JOINT_CODES as _JOINT_CODES
from fedcomp.rules import SUMMED_CODES

#: Memory names accepted by make_codec, with the inner codec given as ``inner=<name>``.
MEMORIES = ("ef", "residual", "ef21", "dgc")
#: Joint codes: no per-client decoder; the server decodes all replies together.
JOINT_CODES = _JOINT_CODES
#: Codes that only work as a whole reply's code, never inside a memory or a stage:
#: the joint codes and the summed ones (FetchSGD's sketch, decoded as a sum).
WHOLE_CODES = JOINT_CODES + SUMMED_CODES


def make_joint_code(name: str, **params: Any):
    """Build a joint code (``onebit``), naming a parameter it does not take."""
    from fedcomp.onebit import OneBitCode  # imported lazily: the joint path is optional

    _check_params(name, params, set(OneBitCode.__dataclass_fields__))
    return OneBitCode(**params)


def _check_params(name: str, params: Mapping[str, Any], accepted: set[str]) -> None:
    """A parameter the codec does not take is an error that lists the ones it does."""
    unknown = sorted(set(params) - accepted)
    if unknown:
        raise ValueError(
            f"codec {name!r} does not take parameter(s) {', '.join(unknown)}; "
            f"it takes: {', '.join(sorted(accepted)) or 'no parameters'}"
        )


def _make_rotated(params: dict[str, Any]) -> RotatedCodec:
    """``rotate`` around a stateless codec: its own keys, the rest go to the inner one."""
    inner = params.pop("inner", None)
    rotation = {k: params.pop(k) for k in ("rotations", "rotation_block") if k in params}
    if not isinstance(inner, str) or inner in MEMORIES or inner in WHOLE_CODES or inner == "rotate":
        raise ValueError(
            f"rotate needs inner=<stateless codec name> (not a memory, a joint or summed "
            f"code or rotate), got inner={inner!r}"
        )
    return RotatedCodec(make_codec(inner, **params), **rotation)


def _make_subsampled(params: dict[str, Any]) -> SubsampledCodec:
    """``subsample`` around a stateless codec: its fraction, the rest go to the inner one."""
    inner = params.pop("inner", None)
    if "fraction" not in params:
        raise ValueError("subsample needs fraction=<share of the coordinates kept, in (0, 1]>")
    fraction = params.pop("fraction")
    if (
        not isinstance(inner, str)
        or inner in MEMORIES
        or inner in WHOLE_CODES
        or inner in (SubsampledCodec.name,)
    ):
        raise ValueError(
            f"subsample needs inner=<stateless codec name> (not a memory, a joint or "
            f"summed code or subsample), got inner={inner!r}"
        )
    return SubsampledCodec(make_codec(inner, **params), fraction=fraction)


def make_codec(name: str, **params: Any) -> Codec | Memory | Any:
    """Build a codec (or a memory around one) by name, validating its parameters.

    ``make_codec("ef", inner="sign", block=256)`` builds error feedback around
    ``make_codec("sign", block=256)``; ``make_codec("rotate", inner="uniform", bits=2)``
    a randomized Hadamard rotation in front of ``uniform``; ``make_codec("onebit", bits=1)``
    returns the joint :class:`fedcomp.onebit.OneBitCode`.

    ``entropy="zstd"`` (and optionally ``entropy_level``) on any stateless codec adds the
    lossless stage of :mod:`fedcomp.codecs.entropy`; on a memory it applies to the inner
    codec.

    Raises
    ------
    ValueError
        On an unknown codec name or a parameter the codec does not take, naming it.
    """
    if name == EntropyCodec.name:
        raise ValueError("the lossless stage is a key of a codec: e.g. codec.entropy=zstd")
    if name in WHOLE_CODES and "entropy" in params:
        kind = "joint" if name in JOINT_CODES else "summed"
        raise ValueError(
            f"entropy does not apply to the {kind} code {name!r}: the server "
            "reads its payloads together"
        )

    if name in JOINT_CODES:
        return make_joint_code(name, **params)
    if name not in MEMORIES and "entropy" in params:
        method = params.pop("entropy")
        level = params.pop("entropy_level", DEFAULT_LEVEL)
        return EntropyCodec(make_codec(name, **params), method=method, level=level)
    if name == RotatedCodec.name:
        return _make_rotated(params)
    if name == SubsampledCodec.name:
        return _make_subsampled(params)
    if name in MEMORIES or name == PowerSGDMemory.name:
        return _make_memory(name, params)
    return _make_stateless(name, params)


def _make_memory(name: str, params: dict[str, Any]) -> Memory:
    """A memory: its own keys, the rest go to the inner codec it keeps state around
    (PowerSGD's codec is fixed: it takes only its rank)."""
    if name == PowerSGDMemory.name:
        _check_params(name, params, {"rank"})
        return PowerSGDMemory(**params)
    inner = params.pop("inner", None)
    own = {"dgc": ("momentum", "clip", "warmup_rounds", "warmup_start"),
           "residual": ("alpha", "bootstrap", "bias_draws"),
           "ef21": ("momentum", "alpha", "bootstrap")}.get(name, ())  # fmt: skip
    options = {k: params.pop(k) for k in own if k in params}
    codec = _inner_codec(name, inner, params)
    if name == "ef":
        return ErrorFeedback(codec)
    if name == "dgc":
        return DGCMemory(codec, **options)
    if name == "ef21":
        return EF21Memory(codec, **options)
    return ResidualMemory(codec, **options)


def _inner_codec(memory: str, inner: Any, params: dict[str, Any]) -> Codec:
    """A memory's inner codec: a name with the memory's other keys as its parameters,
    or a whole spec (a mapping with a name) when the inner codec is itself a wrapper
    with an ``inner`` of its own: ``{"name": "residual", "inner": {"name": "subsample",
    "inner": "uniform", "fraction": 0.25, "bits": 2}}``."""
    if isinstance(inner, Mapping):
        if params:
            raise ValueError(
                f"{memory}: with a whole inner spec, the inner codec's parameters go in "
                f"it, not beside it: {', '.join(sorted(params))}"
            )
        if inner.get("name") in MEMORIES or inner.get("name") == PowerSGDMemory.name:
            raise ValueError(f"{memory}: inner {inner.get('name')!r} is a memory, not a codec")
        if inner.get("name") in WHOLE_CODES:
            raise ValueError(f"{memory}: inner {inner.get('name')!r} is a whole reply's code")
        return make_codec_from_spec(inner)
    if not isinstance(inner, str) or inner in MEMORIES or inner in SUMMED_CODES:
        raise ValueError(
            f"{memory} needs inner=<codec name> or inner=<codec spec> (not a memory or a "
            f"summed code), got inner={inner!r}"
        )
    return make_codec(inner, **params)


def _make_stateless(name: str, params: dict[str, Any]) -> Codec:
    """A registered stateless codec, given only the parameters its constructor names."""
    try:
        cls = codec_class(name)
    except ValueError:
        raise ValueError(
            f"unknown codec {name!r}; known codecs: {', '.join(codec_names())}; "
            f"memories: {', '.join(MEMORIES)}; joint codes: {', '.join(JOINT_CODES)}"
        ) from None
    accepted = {
        pname
        for pname, param in inspect.signature(cls.__init__).parameters.items()
        if pname != "self"
        and param.kind is not param.VAR_POSITIONAL
        and param.kind is not param.VAR_KEYWORD
    }
    _check_params(name, params, accepted)
    return cls(**params)


def make_codec_from_spec(spec: Mapping[str, Any]) -> Codec | Memory:
    """Build a codec from a spec mapping such as ``{"name": "fp32"}``."""
    if "name" not in spec:
        raise ValueError(f"a codec spec needs a 'name', got {dict(spec)!r}")
    params = {k: v for k, v in spec.items() if k != "name"}
    return make_codec(str(spec["name"]), **params)


__all__ = [
    "JOINT_CODES",
    "WHOLE_CODES",
    "Codec",
    "DGCMemory",
    "EF21Memory",
    "ErrorFeedback",
    "Memory",
    "Payload",
    "PayloadError",
    "PayloadHeader",
    "PowerSGDMemory",
    "ResidualMemory",
    "TensorPolicy",
    "codec_class_by_id",
    "codec_names",
    "decode_bytes",
    "make_codec",
    "make_codec_from_spec",
    "parse_payload",
]
