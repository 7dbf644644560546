"""The fp32 reference of a train reply, computed by the server.

A reply's compression ratio compares it with what plain Flower would have sent for the
same round: the app's own reply content, the trained model as one ArrayRecord and its
metrics as one MetricRecord (Flower's quickstart layout, ``arrays`` and ``metrics``),
and the model's tensors under the fp32 codec. Every one of these sizes follows from
the global model's names, shapes and dtypes and from the reply's own metrics, which
the server holds: nothing a client reports about its size is taken at its word (a
client claiming a huge fp32 size made a run report a ratio of 6.2e8).

The one thing the server cannot see is the trained values; two tensors with equal
values would be sent once by Flower (identical objects), so the reference gives every
tensor distinct values: what a trained model has.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

from fedcomp.codecs import TensorPolicy, make_codec
from fedcomp.codecs.policy import encode_all
from fedcomp.compact import entry_size
from fedcomp.flower.accounting import wire_and_objects
from fedcomp.keys import RECORD_METRICS

#: The ArrayRecord name of the reference reply (Flower's quickstart apps use it).
REFERENCE_ARRAYS = "arrays"


def distinct_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Arrays of the same names, shapes and dtypes whose values differ from tensor to
    tensor and within each (no two of Flower's objects coincide)."""
    out = {}
    for i, (name, value) in enumerate(arrays.items()):
        filled = np.arange(value.size, dtype=np.float64) + 1_000_003.0 * (i + 1)
        out[name] = np.asarray(filled.reshape(value.shape)).astype(value.dtype)
    return out


class ReplyReference:
    """The fp32 reference of one reply for a model layout and tensor policy: the codec
    bytes (the same tensors under the fp32 codec) and the plain reply content's wire
    bytes and objects, given the reply's metrics. Built once per layout."""

    def __init__(self, arrays: Mapping[str, np.ndarray], policy: TensorPolicy) -> None:
        self.layout = layout_of(arrays)
        model = distinct_arrays(arrays)
        tensors = {k: torch.from_numpy(np.array(v)) for k, v in model.items()}
        payloads = encode_all(make_codec("fp32"), policy, tensors, dict.fromkeys(tensors, 0))
        self.codec_bytes = sum(entry_size(p) for p in payloads.values())
        content = RecordDict(
            {
                REFERENCE_ARRAYS: ArrayRecord({k: Array(v) for k, v in model.items()}),
                RECORD_METRICS: MetricRecord({}),
            }
        )
        self._wire, self._objects = wire_and_objects(content)
        self._empty_metrics = wire_and_objects(MetricRecord({}))[0]

    def content(self, metrics: MetricRecord) -> tuple[int, int]:
        """Wire bytes and objects of the plain reply content with these metrics: the
        content's objects refer to their children by fixed-length ids, so only the
        metric record's own bytes change."""
        wire = self._wire - self._empty_metrics + wire_and_objects(MetricRecord(metrics))[0]
        return wire, self._objects


def layout_of(arrays: Mapping[str, np.ndarray]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """Names, dtypes and shapes, in order: what the reference depends on."""
    return tuple((k, np.asarray(v).dtype.str, tuple(np.shape(v))) for k, v in arrays.items())
