"""The compressed train reply's layout, both halves: what the mod writes and what the
wrapper reads (protocol version 2).

A reply is its Message and three Flower objects: the RecordDict, the header
ConfigRecord (the header fields and every tensor's payload in one bundle,
fedcomp.bundle) and the MetricRecord. Version 1 had one Array (and its chunk) per
tensor besides: two HTTP calls per tensor on a Deployment Engine, whatever the
payload weighed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedcomp.bundle import pack_bundle, unpack_bundle
from fedcomp.keys import KEY_PAYLOADS, RECORD_HEADER, RECORD_METRICS

#: The most payloads a reply read without the model's names may hold (tests, tools).
MAX_TENSORS = 1 << 16


def reply_content(
    header: Mapping[str, Any], payloads: Mapping[str, bytes], metrics: MetricRecord
) -> RecordDict:
    """The reply content: ``header`` fields plus the payload bundle (model order), and
    the metrics."""
    record = ConfigRecord({**header, KEY_PAYLOADS: pack_bundle(payloads)})
    return RecordDict({RECORD_HEADER: record, RECORD_METRICS: metrics})


def payloads_of(header: ConfigRecord, names: Sequence[str] | None = None) -> dict[str, memoryview]:
    """The reply's payloads, views into its bundle; with ``names`` exactly those
    tensors in that order (fedcomp.bundle.BundleError otherwise)."""
    bound = MAX_TENSORS if names is None else len(names)
    return unpack_bundle(header.get(KEY_PAYLOADS), max_entries=bound, names=names)


def replace_payloads(content: RecordDict, payloads: Mapping[str, bytes]) -> None:
    """Put other payloads into a reply (in place): what a tool or a test that plays a
    hostile client does."""
    content[RECORD_HEADER][KEY_PAYLOADS] = pack_bundle(payloads)
