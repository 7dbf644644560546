"""The compressed train reply's layout, both halves: what the mod writes and what the
wrapper reads (protocol version 4: compact payload entries, fedcomp.compact; version 3
had full payload headers; version 2 had the same layout with the per-step
checksums and the downlink codec in every instruction, and a codec-bytes metric).

A reply is the fewest objects a Flower message can be: its Message, its RecordDict
and one ConfigRecord, the header, holding the header fields, every tensor's payload in
one bundle (fedcomp.bundle) and every metric under :data:`METRIC_PREFIX`. Version 1
had a MetricRecord and one Array (and its chunk) per tensor besides: on a Deployment
Engine each object is an HTTP call of about 1 KB, whatever it weighs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedcomp.bundle import pack_bundle, unpack_bundle
from fedcomp.compact import HeaderRule
from fedcomp.keys import KEY_PAYLOADS, RECORD_HEADER

#: Header entries holding the reply's metrics: ``METRIC_PREFIX + name`` (the app's own
#: metrics and fedcomp's measurements; the wrapper rebuilds the MetricRecord).
METRIC_PREFIX = "metric:"

#: The most payloads a reply read without the model's names may hold (tests, tools).
MAX_TENSORS = 1 << 16


def reply_content(
    header: Mapping[str, Any], payloads: Mapping[str, bytes], metrics: MetricRecord
) -> RecordDict:
    """The reply content, one record: ``header`` fields, the payload bundle (model
    order, compact: the server reads it with the model's names, shapes and seeds) and
    the metrics."""
    fields = {**header, KEY_PAYLOADS: pack_bundle(payloads, named=False, compact=True)}
    fields.update({METRIC_PREFIX + k: v for k, v in metrics.items()})
    return RecordDict({RECORD_HEADER: ConfigRecord(fields)})


def payloads_of(
    header: ConfigRecord, names: Sequence[str] | None = None, headers: HeaderRule | None = None
) -> dict[str, memoryview]:
    """The reply's payloads, full payloads; with ``names`` exactly those tensors in that
    order (fedcomp.bundle.BundleError otherwise). ``headers`` rebuilds a compact
    bundle's payload headers (fedcomp.flower.validation.uplink_headers)."""
    bound = MAX_TENSORS if names is None else len(names)
    return unpack_bundle(header.get(KEY_PAYLOADS), max_entries=bound, names=names, headers=headers)


def metrics_of(header: ConfigRecord) -> MetricRecord:
    """The reply's metrics, rebuilt from the header's metric entries.

    Raises
    ------
    TypeError
        An entry that is not a number or a list of numbers of one type (Flower's
        MetricRecord refuses it; a bool is not a number here).
    """
    values = {
        k.removeprefix(METRIC_PREFIX): v for k, v in header.items() if k.startswith(METRIC_PREFIX)
    }
    for name, value in values.items():
        items = value if isinstance(value, list) else [value]
        if any(isinstance(v, bool) for v in items):
            raise TypeError(f"metric {name}={value!r:.80} is not a number")
    return MetricRecord(values)


def replace_metrics(content: RecordDict, metrics: Mapping[str, Any]) -> None:
    """Put other metrics into a reply (in place; tools and tests that play a client)."""
    header = content[RECORD_HEADER]
    for key in [k for k in header if k.startswith(METRIC_PREFIX)]:
        del header[key]
    header.update({METRIC_PREFIX + k: v for k, v in metrics.items()})
