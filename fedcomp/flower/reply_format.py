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
from fedcomp.flower.packed import opened, pack_into
from fedcomp.keys import KEY_PAYLOADS, METRIC_PREFIX, RECORD_HEADER

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
    record = ConfigRecord(fields)
    pack_into(record)  # fedcomp's fields and metrics in one entry (fedcomp.flower.packed)
    return RecordDict({RECORD_HEADER: record})


def reply_header(content: RecordDict) -> ConfigRecord | None:
    """A reply's header as its readers read it, its packed fields opened (a new
    record; fedcomp.flower.packed), or None without one.

    Raises
    ------
    fedcomp.flower.packed.PackError
        A packed entry that does not read back.
    """
    header = content.config_records.get(RECORD_HEADER)
    return None if header is None else opened(header)


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


def open_reply(content: RecordDict) -> ConfigRecord:
    """The reply's header, its packed fields opened, in place of the one sent: what a
    tool or a test that plays a client does before it edits fields (a reply may carry
    them either way). Returns the header."""
    header = reply_header(content)
    if header is None:
        raise KeyError(f"the reply has no '{RECORD_HEADER}' record")
    content[RECORD_HEADER] = header
    return header


def replace_metrics(content: RecordDict, metrics: Mapping[str, Any]) -> None:
    """Put other metrics into a reply (in place; tools and tests that play a client)."""
    header = open_reply(content)
    for key in [k for k in header if k.startswith(METRIC_PREFIX)]:
        del header[key]
    header.update({METRIC_PREFIX + k: v for k, v in metrics.items()})
