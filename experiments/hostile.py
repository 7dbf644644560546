"""Hostile clients for the reliability tests and benchmark: reply tamperers that act
as a client sending bombs, lies and duplicates, and one in-process round driver.

Each behaviour is a tamper function of :class:`experiments.inprocess.InProcessGrid`
(partition id, reply, instruction) -> reply(s). ``run_round`` drives real clients and
the real wrapper through ``CompressedStrategy.start`` and measures the server's peak
memory while it aggregates the last round (tests/test_hostile_clients.py,
experiments/bench_reliability.py).
"""

from __future__ import annotations

import struct

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from clients.client_app import make_client_app
from experiments.inprocess import InProcessGrid, initial_arrays, set_task_identity
from experiments.memory import address_space_cap, peak_rss, reset_peak_rss
from fedcomp.bundle import is_positional, pack_bundle
from fedcomp.failures import Failure
from fedcomp.flower.options import IdentityOptions, ServerOptions
from fedcomp.flower.packed import opened
from fedcomp.flower.reply_format import metrics_of, replace_metrics, reply_header
from fedcomp.flower.strategy import CompressedStrategy
from fedcomp.flower.validation import sent_payloads
from fedcomp.handoff_options import Aggregation
from fedcomp.keys import (
    KEY_CV_VERSION,
    KEY_NUM_EXAMPLES,
    KEY_PACKED,
    KEY_PAYLOADS,
    KEY_PROTOCOL,
    KEY_RESYNC,
    KEY_ROUND,
    KEY_RUN_SEED,
    KEY_STABLE_ID,
    RECORD_HEADER,
)
from fedcomp.settings import settings_from_dict
from strategies.inner import make_inner_strategy
from strategies.server_app import client_task

HONEST, HOSTILE = list(range(10)), [10, 11, 12]
N = len(HONEST) + len(HOSTILE)
UNIFORM = {"name": "uniform", "bits": 8, "block": 256}


def _replace(reply: Message, instruction: Message, **records) -> Message:
    content = RecordDict(dict(reply.content.items()))
    for key, value in records.items():
        content[key] = value
    return Message(content, reply_to=instruction)


def _full_payloads(reply: Message, instruction: Message) -> dict[str, bytes]:
    """The reply's payloads in full, read as the server reads them (the instruction
    carries the model: the hostile rounds send it in full, and the run seed)."""
    ((arrays,),) = [list(instruction.content.array_records.values())]
    model = {k: v.numpy() for k, v in arrays.items()}
    config = next(opened(c) for c in instruction.content.config_records.values() if KEY_PACKED in c)
    header = reply_header(reply.content)
    return {n: bytes(p) for n, p in sent_payloads(header, model, config[KEY_RUN_SEED]).items()}


def _map_payloads(reply: Message, instruction: Message, change) -> Message:
    """The reply with ``change`` applied to each payload in full, sent as a positional
    bundle of full payloads (protocol 3's form, which a client may still send): the
    changes reach the header fields a compact entry leaves to the server."""
    changed = {}
    for name, payload in _full_payloads(reply, instruction).items():
        buf = bytearray(payload)
        change(name, buf)
        changed[name] = bytes(buf)
    return _header(reply, instruction, **{KEY_PAYLOADS: pack_bundle(changed, named=False)})


def _header(reply: Message, instruction: Message, **fields) -> Message:
    # its fields opened: a reply may carry them packed or as entries (fedcomp.flower.packed)
    header = ConfigRecord(dict(reply_header(reply.content)))
    for key, value in fields.items():
        header[key] = value
    return _replace(reply, instruction, **{RECORD_HEADER: header})


def _body_offset(buf: bytearray) -> int:
    return 16 + 4 * buf[5]  # fixed header, then one uint32 per dimension


def block_bomb(pid, reply, instruction):
    """(a) The block field of every quantized payload set to 2^31 - 1."""

    def change(name, buf):
        if buf[3] == 4:  # uniform: u8 bits, u8 0, u32 block
            struct.pack_into("<I", buf, _body_offset(buf) + 2, 2**31 - 1)

    return _map_payloads(reply, instruction, change)


def max_everything(pid, reply, instruction):
    """(b) A valid fixed header whose every dimension and body parameter is at the
    largest value its field can hold."""

    def change(name, buf):
        body = _body_offset(buf)
        for dim in range(buf[5]):
            struct.pack_into("<I", buf, 16 + 4 * dim, 2**32 - 1)
        if buf[3] == 4:
            struct.pack_into("<BBI", buf, body, 255, 255, 2**32 - 1)

    return _map_payloads(reply, instruction, change)


def huge_values(pid, reply, instruction):
    """(c) A well-formed payload of the asked codec whose scales make it decode to
    finite values near 1e37."""

    def change(name, buf):
        if buf[3] == 4:
            body = _body_offset(buf)
            numel = int(np.prod(struct.unpack_from(f"<{buf[5]}I", buf, 16)))
            blocks = -(-numel // 256)
            struct.pack_into(f"<{blocks}f", buf, body + 6, *([1e37] * blocks))

    return _map_payloads(reply, instruction, change)


def wrong_round(pid, reply, instruction):
    """(d) A reply claiming another round."""
    header = reply_header(reply.content)
    return _header(reply, instruction, **{KEY_ROUND: int(header[KEY_ROUND]) - 1})


def other_client(pid, reply, instruction):
    """(d) A reply claiming an honest client's stable id."""
    return _header(reply, instruction, **{KEY_STABLE_ID: HONEST[pid % len(HONEST)]})


def future_protocol(pid, reply, instruction):
    """A reply speaking a protocol version the server does not."""
    return _header(reply, instruction, **{KEY_PROTOCOL: 99})


def renamed_tensor(pid, reply, instruction):
    """A reply whose payload bundle names a tensor the model does not have."""
    payloads = _full_payloads(reply, instruction)
    names = list(payloads.keys())
    renamed = {("evil." + n if i == 0 else n): payloads[n] for i, n in enumerate(names)}
    return _header(reply, instruction, **{KEY_PAYLOADS: pack_bundle(renamed)})


def wrong_dtype(pid, reply, instruction):
    """A payload header declaring float64 for a float32 tensor (dtype code 3)."""

    def change(name, buf):
        if buf[4] == 0:
            buf[4] = 3

    return _map_payloads(reply, instruction, change)


def bundle_count_bomb(pid, reply, instruction):
    """A payload bundle whose count field claims 2^32 - 1 payloads."""
    header = reply.content.config_records[RECORD_HEADER]
    blob = bytearray(header[KEY_PAYLOADS])
    struct.pack_into("<I", blob, 3, 2**32 - 1)  # after the magic and the version
    return _header(reply, instruction, **{KEY_PAYLOADS: bytes(blob)})


def bundle_length_bomb(pid, reply, instruction):
    """A payload bundle whose first payload claims 2^32 - 1 bytes."""
    header = reply.content.config_records[RECORD_HEADER]
    blob = bytearray(header[KEY_PAYLOADS])
    if is_positional(bytes(blob)):  # the lengths follow the 7-byte head
        struct.pack_into("<I", blob, 7, 2**32 - 1)
    else:  # after the first name
        (name_length,) = struct.unpack_from("<H", blob, 7)
        struct.pack_into("<I", blob, 9 + name_length, 2**32 - 1)
    return _header(reply, instruction, **{KEY_PAYLOADS: bytes(blob)})


def payloads_as_text(pid, reply, instruction):
    """The payload bundle replaced by a string of the same length."""
    header = reply.content.config_records[RECORD_HEADER]
    return _header(reply, instruction, **{KEY_PAYLOADS: "x" * len(header[KEY_PAYLOADS])})


def extra_train_metric(pid, reply, instruction):
    """1: a train reply with one more metric name than the others."""
    return _metrics(reply, instruction, lambda m: m.__setitem__("surprise", 1.0))


def list_train_metric(pid, reply, instruction):
    """1: a train metric that is a list where the others send a number."""
    return _metrics(reply, instruction, lambda m: m.__setitem__("train_loss", [1.0, 2.0]))


def nan_train_metric(pid, reply, instruction):
    """A NaN train metric."""
    return _metrics(reply, instruction, lambda m: m.__setitem__("train_loss", float("nan")))


def overflow_weight(pid, reply, instruction):
    """5: num-examples 1e308: two of them overflow the round's total weight."""
    return _metrics(reply, instruction, lambda m: m.__setitem__(KEY_NUM_EXAMPLES, 1e308))


def twice(pid, reply, instruction):
    """(e) The same reply sent twice."""
    return [reply, reply]


SCENARIOS = [
    (block_bomb, Failure.SPEC_MISMATCH, 1),
    (max_everything, Failure.MALFORMED, 1),
    (huge_values, Failure.OUTLIER, 1),
    (wrong_round, Failure.WRONG_ROUND, 1),
    (other_client, Failure.WRONG_CLIENT, 1),
    (twice, Failure.DUPLICATE, 2),
    (future_protocol, Failure.PROTOCOL, 1),
    (renamed_tensor, Failure.BAD_LAYOUT, 1),
    (wrong_dtype, Failure.BAD_LAYOUT, 1),
    (bundle_count_bomb, Failure.BAD_LAYOUT, 1),
    (bundle_length_bomb, Failure.BAD_LAYOUT, 1),
    (payloads_as_text, Failure.BAD_LAYOUT, 1),
    (extra_train_metric, Failure.BAD_METRICS, 1),
    (list_train_metric, Failure.BAD_METRICS, 1),
    (nan_train_metric, Failure.BAD_METRICS, 1),
    (overflow_weight, Failure.BAD_WEIGHT, 1),
]


def _hostile(behaviour, kind: str = MessageType.TRAIN, hostile_ids=tuple(HOSTILE)):
    def tamper(pid, reply, instruction):
        hostile = pid in hostile_ids and instruction.metadata.message_type == kind
        if not hostile or reply.has_error():
            return reply
        return None if behaviour is None else behaviour(pid, reply, instruction)

    return tamper


class PeakNotMeasurable(RuntimeError):
    """The kernel's peak-RSS mark cannot be reset here (no writable
    /proc/self/clear_refs): a measured peak would be 0, not the aggregation's."""


def run_round(
    codec,
    behaviour,
    *,
    handoff="per_client",
    rounds=1,
    on_grid=None,
    evaluate=False,
    tamper=None,
    num_clients=N,
    hostile=tuple(HOSTILE),
    influence=None,
    inner=None,
    client_mods=None,
):
    """``rounds`` rounds through CompressedStrategy.start; the hostile clients act in
    the last one (and are honest before), on the train replies or, with ``evaluate``,
    on the evaluate replies (every client then evaluates). ``tamper`` replaces the
    hostile-clients tamperer for every round. ``num_clients``, ``hostile`` (their
    partition ids), ``influence`` and ``inner`` (a Flower strategy) change the round's
    make-up; ``client_mods``: inner train mods of every client (they see the dense
    reply, e.g. experiments.attacks.AttackMod). Returns the strategy, the result and
    the server's peak memory while aggregating that round's train replies."""
    set_task_identity()  # module-scoped fixtures run before conftest's autouse one
    # Without a reset the mark stays at the process's lifetime peak, so the peak of the
    # aggregation would read as 0 and every memory bound would pass: refuse instead.
    if not reset_peak_rss():
        raise PeakNotMeasurable(
            "cannot reset the kernel's peak-RSS mark (/proc/self/clear_refs is not "
            "writable here): the server's peak memory while aggregating cannot be measured"
        )
    fraction_evaluate = 1.0 if evaluate else 0.0
    settings = settings_from_dict(
        {
            "num_clients": num_clients,
            "fraction_evaluate": fraction_evaluate,
            "codec": codec,
            "train": {"local_epochs": 1},
        }
    )
    act = _hostile(behaviour, MessageType.EVALUATE if evaluate else MessageType.TRAIN, hostile)
    grid = InProcessGrid(
        make_client_app(inner_mods=client_mods),
        num_clients,
        tamper=tamper or (lambda pid, r, i: act(pid, r, i) if _round_of(i) == rounds else r),
    )
    strategy = CompressedStrategy(
        inner
        or make_inner_strategy(
            {"name": "fedavg"}, num_clients, fraction_evaluate=fraction_evaluate
        ),
        codec=codec,
        run_seed=settings.seed,
        options=ServerOptions(
            aggregation=Aggregation(handoff=handoff),
            influence=influence,
            task=client_task(settings),
            identity=IdentityOptions(timeout=5),
        ),
    )
    peaks = []
    aggregate = strategy.aggregate_train

    def measured(server_round, replies):
        replies = list(replies)
        if not reset_peak_rss():  # checked above; a mark that stops resetting is no peak
            raise PeakNotMeasurable("the peak-RSS mark could not be reset before aggregating")
        base = peak_rss()
        with address_space_cap(4 << 30):
            out = aggregate(server_round, replies)
        peaks.append(max(0, peak_rss() - base))  # the mark was reset to ``base``
        return out

    strategy.aggregate_train = measured  # type: ignore[method-assign]
    result = strategy.start(grid=grid, initial_arrays=initial_arrays(settings), num_rounds=rounds)
    if on_grid is not None:
        on_grid(grid, strategy)
    return strategy, result, peaks[-1]


def _round_of(instruction: Message) -> int:
    return int(instruction.metadata.group_id or 0)  # identity queries carry none


def same_arrays(a: ArrayRecord, b: ArrayRecord) -> bool:
    """Bit-identical arrays under the same names, in the same order."""
    return list(a.keys()) == list(b.keys()) and all(
        np.array_equal(a[name].numpy(), b[name].numpy()) for name in a.keys()
    )


ONEBIT = {"name": "onebit", "bits": 1, "lam": 50.0}


def onebit_bomb(pid, reply, instruction):
    """(a)/(b) for the joint code: block and client count in the preamble at the
    largest value their fields hold."""

    def change(name, buf):
        if buf[3] == 9:  # the one-bit preamble: u8 x4, then index, n, block, digest
            body = _body_offset(buf)
            struct.pack_into("<II", buf, body + 8, 2**32 - 1, 2**32 - 1)

    return _map_payloads(reply, instruction, change)


RESIDUAL = {"name": "residual", "inner": "uniform", "bits": 2, "block": 64}


def residual_liars(pid, reply, instruction):
    """10: a control-variate version it never had; 11: its own version and checksum
    (forged to match) but an update blown up 10^6 times; 12: an unknown sync mode."""
    if pid == 10:
        return _header(reply, instruction, **{KEY_CV_VERSION: 7})
    if pid == 12:
        return _header(reply, instruction, **{KEY_RESYNC: 5})
    return huge_values(pid, reply, instruction)


def _metrics(reply: Message, instruction: Message, change) -> Message:
    """The reply with ``change`` applied to its metrics: a train reply's live in its
    header (fedcomp.flower.reply_format), an evaluate reply's in its MetricRecord."""
    header = reply_header(reply.content)
    if header is not None and KEY_PAYLOADS in header:
        metrics = metrics_of(header)
        change(metrics)
        content = RecordDict(dict(reply.content.items()))
        content[RECORD_HEADER] = ConfigRecord(dict(header))
        replace_metrics(content, metrics)
        return Message(content, reply_to=instruction)
    metrics = MetricRecord(dict(reply.content["metrics"]))
    change(metrics)
    return _replace(reply, instruction, metrics=metrics)


def extra_metric(pid, reply, instruction):
    """An evaluate reply with one more metric name than the others."""
    return _metrics(reply, instruction, lambda m: m.__setitem__("surprise", 1.0))


def nan_metric(pid, reply, instruction):
    """An evaluate reply with a NaN loss."""
    return _metrics(reply, instruction, lambda m: m.__setitem__("eval_loss", float("nan")))


def two_metric_records(pid, reply, instruction):
    """An evaluate reply with a second MetricRecord."""
    return _replace(reply, instruction, more=MetricRecord({"num-examples": 1}))
