"""The mod and the wrapper together, in-process: FedAvg equivalence against a float64
reference, run-to-run and reply-order determinism, byte accounting from the real
messages, and bad replies that become failures without touching the others."""

from __future__ import annotations

import logging
import math
import struct

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import ErrorCode
from flwr.serverapp.strategy import FedAvg, FedMedian
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from clients.client_app import make_client_app
from experiments.inprocess import NODE_IDS, InProcessGrid, Spy, initial_arrays, set_task_identity
from fedcomp.bundle import pack_bundle
from fedcomp.codecs import decode_bytes, make_codec
from fedcomp.codecs.wire import HEADER_FIXED_BYTES
from fedcomp.compact import SEEDED, compact_entry
from fedcomp.flower.mod import CompressionMod
from fedcomp.flower.options import IdentityOptions, ServerOptions
from fedcomp.flower.reply_format import (
    metrics_of,
    open_reply,
    replace_metrics,
    reply_header,
)
from fedcomp.flower.strategy import CompressedStrategy
from fedcomp.flower.validation import sent_payloads
from fedcomp.handoff_options import Aggregation
from fedcomp.keys import (
    KEY_NUM_EXAMPLES,
    KEY_PACKED,
    KEY_PAYLOADS,
    KEY_STABLE_ID,
    RECORD_HEADER,
)
from fedcomp.models import build_model
from fedcomp.rules import codec_chain
from fedcomp.settings import Settings, settings_from_dict
from fedcomp.trees.aggregate import TreeConfig
from strategies.inner import make_inner_strategy
from strategies.server_app import client_task, run_server

U32 = 2.0**-24  # unit roundoff of float32
N = 4
SETTINGS = settings_from_dict({"num_clients": N, "num_rounds": 1, "fraction_evaluate": 0.0})


def _train_only(messages: list[Message]) -> list[Message]:
    """A round's train messages (not the first-contact identity messages, which are
    train messages without a round)."""
    return [
        m
        for m in messages
        if m.metadata.message_type == MessageType.TRAIN and m.metadata.group_id.isdigit()
    ]


_initial = initial_arrays


def one_round(
    settings: Settings = SETTINGS,
    *,
    handoff: str = "per_client",
    inner=None,
    trees=None,
    **grid_kwargs,
) -> tuple[dict[str, np.ndarray], CompressedStrategy, InProcessGrid, Spy]:
    spy = Spy()
    grid = InProcessGrid(make_client_app(inner_mods=[spy]), settings.num_clients, **grid_kwargs)
    strategy = CompressedStrategy(
        inner
        or make_inner_strategy(
            {"name": "fedavg"},
            settings.num_clients,
            fraction_train=settings.fraction_train,
            fraction_evaluate=0.0,
        ),
        codec=settings.codec,
        run_seed=settings.seed,
        options=ServerOptions(
            aggregation=Aggregation(handoff=handoff, trees=trees or TreeConfig()),
            task=client_task(settings),
            identity=IdentityOptions(timeout=5),
        ),
    )
    result = strategy.start(grid, _initial(settings), num_rounds=1)
    arrays = {k: np.array(v.numpy()) for k, v in result.arrays.items()}
    return arrays, strategy, grid, spy


@pytest.mark.parametrize("handoff", ["per_client", "pre_aggregated"])
def test_fp32_matches_fedavg_against_float64_reference(handoff: str) -> None:
    arrays, strategy, _, spy = one_round(handoff=handoff)
    assert strategy.rounds[0]["replied"] == N and strategy.rounds[0]["failures"] == 0
    weights = np.array([spy.weight[i] for i in range(N)])
    factors = weights / weights.sum()
    initial = {k: np.asarray(v.numpy()) for k, v in _initial(SETTINGS).items()}
    for name, got in arrays.items():
        locals64 = np.stack([spy.local[i][name].astype(np.float64) for i in range(N)])
        reference = np.tensordot(factors, locals64, axes=1)
        # float32 error budget: the delta round trip (2u per client) and a k-term
        # weighted sum ((k + 1)u), relative to sum_i f_i |x_i| and |global|.
        scale = np.tensordot(factors, np.abs(locals64), axes=1) + np.abs(initial[name])
        bound = (N + 3) * U32 * scale + np.finfo(np.float32).tiny
        err = np.abs(got.astype(np.float64) - reference)
        assert got.dtype == np.float32
        assert (err <= bound).all(), f"{name}: max err/bound {np.max(err / bound):.3f}"


@pytest.mark.parametrize("handoff", ["per_client", "pre_aggregated"])
def test_bit_identical_run_to_run_and_whatever_the_reply_order(handoff: str) -> None:
    first, *_ = one_round(handoff=handoff)
    again, *_ = one_round(handoff=handoff)
    reversed_, *_ = one_round(handoff=handoff, order=lambda r: r[::-1])
    rotated, *_ = one_round(handoff=handoff, order=lambda r: r[2:] + r[:2])
    for other in (again, reversed_, rotated):
        assert all(np.array_equal(first[k], other[k]) for k in first)


def test_recorded_bytes_equal_the_real_messages() -> None:
    _, strategy, grid, _ = one_round()
    record = strategy.rounds[0]
    rows = {row["client"]: row for row in record["per_client"]}
    model = build_model(SETTINGS.model, SETTINGS.dataset.name, SETTINGS.seed)
    # a compact entry (fedcomp.compact) of an fp32 payload: one byte, then the values
    fp32_packed = sum(1 + 4 * p.numel() for p in model.state_dict().values())
    for reply in _train_only(grid.replies):
        sid = int(reply_header(reply.content)[KEY_STABLE_ID])
        # the entries' bytes: the bundle less its table (magic, version, count, lengths)
        codec_bytes = len(reply.content[RECORD_HEADER][KEY_PAYLOADS]) - 7 - 4 * len(MODEL_NAMES)
        assert rows[sid]["uplink_codec_bytes"] == codec_bytes == fp32_packed
        assert rows[sid]["uplink_record_bytes"] == sum(
            r.count_bytes() for r in reply.content.values()
        )
        wire = _wire(reply)
        assert rows[sid]["uplink_wire_bytes"] == wire > codec_bytes
        # The compact reply: its Message, RecordDict and header, nothing else.
        assert len(get_all_nested_objects(reply)) == 3
        # The fp32 reference is the app's own reply as plain Flower sends it: the
        # trained model (same shapes as the initial one, so the same object sizes) and
        # the app's metrics, in this reply's Message.
        sent = metrics_of(reply_header(reply.content))
        user = {k: v for k, v in sent.items() if not k.startswith("fedcomp.")}
        plain = RecordDict(
            {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(user)}
        )
        expected = wire - _wire(reply.content) + _wire(plain)
        assert rows[sid]["fp32_wire_bytes"] == expected > wire
    for msg in _train_only(grid.sent):
        sid = next(
            s
            for s, n in ((s, strategy.clients.ids.node_of(s)) for s in rows)
            if n == msg.metadata.dst_node_id
        )
        assert rows[sid]["downlink_wire_bytes"] == _wire(msg)
    assert record["uplink_wire_bytes"] == sum(r["uplink_wire_bytes"] for r in rows.values())
    assert record["codec"]["fp32_codec_bytes"] == N * fp32_packed


# ----------------------------------------------------------------------------- bad replies

BAD = 1  # the partition whose reply is tampered with


def _wire(obj) -> int:
    """Flower's deflated objects of a message or content, counted here independently."""
    return sum(len(o.deflate()) for o in get_all_nested_objects(obj).values())


#: The default model's tensor names, in order: a reply's bundle is positional (the
#: server reads it with these names), every test here runs the default model.
MODEL = {k: v.numpy() for k, v in build_model(SETTINGS.model, "digits", 0).state_dict().items()}
MODEL_NAMES = list(MODEL)


def _payloads(reply: Message) -> dict[str, bytes]:
    header = reply_header(reply.content)
    return {n: bytes(p) for n, p in sent_payloads(header, MODEL, SETTINGS.seed).items()}


def _set_payload(reply: Message, name: str, data: bytes) -> Message:
    """The reply with one payload replaced, every payload in full (a positional bundle
    of protocol 3's form, which a client may still send): the server's checks of
    a payload's header fields meet what a tamper wrote there."""
    payloads = {**_payloads(reply), name: data}
    reply.content[RECORD_HEADER][KEY_PAYLOADS] = pack_bundle(payloads, named=False)
    return reply


def _compact_tamper(fn):
    """A tamper of the first compact entry (fedcomp.compact) of a compact bundle."""

    def tamper(reply: Message) -> Message:
        entries = [compact_entry(p) for p in _payloads(reply).values()]
        entries[0] = fn(entries[0])
        head = struct.pack("<2sBI", b"FB", 3, len(entries))
        table = b"".join(struct.pack("<I", len(e)) for e in entries)
        reply.content[RECORD_HEADER][KEY_PAYLOADS] = head + table + b"".join(entries)
        return reply

    return tamper


def _payload(reply: Message, name: str) -> bytes:
    return _payloads(reply)[name]


def _first_name(reply: Message) -> str:
    return next(iter(_payloads(reply)))


def _patched(buf: bytes, offset: int, fmt: str, value: int) -> bytes:
    out = bytearray(buf)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def _nan_payload(reply: Message) -> Message:
    name = _first_name(reply)
    x = decode_bytes(_payload(reply, name)).clone()
    x.view(-1)[0] = math.nan
    return _set_payload(reply, name, bytes(make_codec("fp32").encode(x, seed=0)))


def _reshaped(reply: Message) -> Message:
    name = _first_name(reply)
    x = decode_bytes(_payload(reply, name))
    return _set_payload(reply, name, bytes(make_codec("fp32").encode(x.reshape(-1), seed=0)))


def _error_reply(_: Message, instruction: Message) -> Message:
    return Message(
        Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason="boom"), reply_to=instruction
    )


def _drop_header(reply: Message) -> Message:
    del reply.content[RECORD_HEADER]
    return reply


def _wrong_id(reply: Message) -> Message:
    open_reply(reply.content)[KEY_STABLE_ID] = 99
    return reply


def _packed(change):
    """A tamper of the reply header's packed entry (fedcomp.flower.packed)."""

    def tamper(reply: Message) -> Message:
        header = reply.content[RECORD_HEADER]
        change(header)
        return reply

    return tamper


def _weight(value: float):
    def tamper(reply: Message) -> Message:
        metrics = metrics_of(reply_header(reply.content))
        metrics[KEY_NUM_EXAMPLES] = value
        replace_metrics(reply.content, metrics)
        return reply

    return tamper


def _bytes_tamper(fn):
    def tamper(reply: Message) -> Message:
        name = _first_name(reply)
        return _set_payload(reply, name, fn(_payload(reply, name)))

    return tamper


TAMPERS = {
    "truncated": _bytes_tamper(lambda b: b[:-3]),
    "extended": _bytes_tamper(lambda b: b + b"\x00\x01"),
    "empty": _bytes_tamper(lambda b: b""),
    "unknown_codec_id": _bytes_tamper(lambda b: _patched(b, 3, "<B", 200)),
    "unknown_version": _bytes_tamper(lambda b: _patched(b, 2, "<B", 7)),
    "huge_shape": _bytes_tamper(lambda b: _patched(b, HEADER_FIXED_BYTES, "<I", 2**32 - 1)),
    "seed_mismatch": _bytes_tamper(lambda b: _patched(b, 8, "<Q", 12345)),
    "nan_update": _nan_payload,
    "wrong_shape": _reshaped,
    "missing_header": _drop_header,
    "wrong_stable_id": _wrong_id,
    "negative_weight": _weight(-5),
    "nan_weight": _weight(math.nan),
    "packed_truncated": _packed(lambda h: h.update({KEY_PACKED: h[KEY_PACKED][:-1]})),
    "packed_and_entry": _packed(lambda h: h.update({KEY_STABLE_ID: BAD})),
    "packed_unknown_tag": _packed(
        lambda h: h.update({KEY_PACKED: h[KEY_PACKED] + b"\xff\x00\x00"})
    ),
    "compact_empty": _compact_tamper(lambda e: b""),
    "compact_truncated": _compact_tamper(lambda e: e[:-3]),
    "compact_unknown_codec": _compact_tamper(lambda e: bytes([0x7F]) + e[1:]),
    "compact_seed_flag": _compact_tamper(lambda e: bytes([e[0] ^ SEEDED]) + e[1:]),
}


def _tamper_partition(fn):
    def tamper(pid: int, reply: Message, instruction: Message) -> Message | None:
        if pid != BAD or instruction.metadata.message_type != MessageType.TRAIN:
            return reply
        if fn is _error_reply:
            return fn(reply, instruction)
        return fn(reply)

    return tamper


def _drop_bad(pid: int, reply: Message, instruction: Message) -> Message | None:
    is_train = instruction.metadata.message_type == MessageType.TRAIN
    return None if pid == BAD and is_train else reply


@pytest.fixture(scope="module")
def without_bad_client() -> dict[str, np.ndarray]:
    set_task_identity()  # module-scoped fixtures run before conftest's autouse one
    arrays, strategy, *_ = one_round(tamper=_drop_bad)
    assert strategy.rounds[0]["replied"] == N - 1
    return arrays


@pytest.mark.parametrize("case", [*sorted(TAMPERS), "error_reply"])
def test_bad_reply_is_a_logged_failure_and_the_rest_aggregate(
    case: str, without_bad_client: dict[str, np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    fn = _error_reply if case == "error_reply" else TAMPERS[case]
    arrays, strategy, *_ = one_round(tamper=_tamper_partition(fn))
    record = strategy.rounds[0]
    assert (record["replied"], record["failures"]) == (N - 1, 1)
    assert record["nonfinite"] == (1 if case == "nan_update" else 0)
    # Exactly as if the bad reply had never arrived: nothing of it leaks in.
    assert all(np.array_equal(arrays[k], without_bad_client[k]) for k in arrays)
    assert any(
        f"client {BAD}" in r.getMessage() for r in caplog.records if r.levelname == "WARNING"
    )


def test_mod_without_the_wrapper_answers_with_a_clear_error() -> None:
    app = make_client_app()
    grid = InProcessGrid(app, 1)
    content = RecordDict({"arrays": _initial(SETTINGS), "config": ConfigRecord({"lr": 0.1})})
    msg = Message(content, dst_node_id=NODE_IDS[0], message_type=MessageType.TRAIN)
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error()
    assert reply.error.code == ErrorCode.MOD_FAILED_PRECONDITION
    assert "CompressedStrategy" in reply.error.reason


def test_the_mod_leaves_other_message_types_alone() -> None:
    calls = []

    def call_next(msg, ctxt):
        calls.append(msg)
        return msg

    msg = Message(
        RecordDict({"config": ConfigRecord({})}), dst_node_id=1, message_type=MessageType.EVALUATE
    )
    assert CompressionMod()(msg, None, call_next) is msg and calls == [msg]


def test_pre_aggregated_rejects_strategies_that_are_not_means() -> None:
    with pytest.raises(ValueError, match=r"strategy\.name='fedmedian'.*mean-based"):
        CompressedStrategy(
            FedMedian(),
            codec={"name": "fp32"},
            run_seed=0,
            options=ServerOptions(aggregation=Aggregation(handoff="pre_aggregated")),
        )
    with pytest.raises(ValueError, match="unknown codec"):
        CompressedStrategy(FedAvg(), codec={"name": "nope"}, run_seed=0)


def test_fedmedian_per_client_is_the_coordinatewise_median_of_decoded_models() -> None:
    arrays, _, grid, _ = one_round(inner=make_inner_strategy({"name": "fedmedian"}, N))
    initial = {k: np.asarray(v.numpy()) for k, v in _initial(SETTINGS).items()}
    for name, got in arrays.items():
        dense = np.stack(
            [
                initial[name] + decode_bytes(_payload(r, name)).numpy()
                for r in _train_only(grid.replies)
            ]
        )
        assert np.array_equal(got, np.median(dense, axis=0).astype(np.float32))


def test_sampling_follows_stable_ids_not_flower_node_ids() -> None:
    settings = settings_from_dict(
        {"num_clients": N, "num_rounds": 1, "fraction_train": 0.5, "fraction_evaluate": 0.0}
    )
    chosen = []
    for node_ids in (NODE_IDS, NODE_IDS[::-1]):
        _, strategy, _, spy = one_round(settings, node_ids=node_ids)
        assert strategy.rounds[0]["selected"] == 2
        chosen.append(sorted(spy.local))
    assert chosen[0] == chosen[1]


def test_whole_job_in_process_learns_and_reports(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO")
    settings = settings_from_dict(
        {"num_clients": N, "num_rounds": 2, "strategy": {"name": "fedadam", "eta": 0.01}}
    )
    seen = []
    results = run_server(InProcessGrid(make_client_app(), N), settings, on_round=seen.append)
    assert [r["round"] for r in seen] == [1, 2] == [r["round"] for r in results["rounds"]]
    assert results["summary"]["final_accuracy"] > results["summary"]["initial_accuracy"] + 0.2
    # the clients' own evaluation of the final model learned by the same margin
    client_accuracy = results["rounds"][-1]["client_accuracy"]
    assert results["summary"]["initial_accuracy"] + 0.2 < client_accuracy <= 1.0
    assert results["summary"]["ratio_vs_fp32_codec"] == 1.0
    assert any("round 2/2 | accuracy" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "spec",
    [{"name": "fedadam", "eta": 0.01}, {"name": "fedavgm", "server_momentum": 0.9}],
)
def test_server_optimizers_see_the_same_mean_in_both_modes(spec: dict) -> None:
    per_client, *_ = one_round(inner=make_inner_strategy(spec, N))
    pre, *_ = one_round(inner=make_inner_strategy(spec, N), handoff="pre_aggregated")
    initial = {k: np.asarray(v.numpy()) for k, v in _initial(SETTINGS).items()}
    moved = max(np.max(np.abs(pre[k] - initial[k])) for k in pre)
    assert moved > 1e-3  # the server step did something
    for name in per_client:
        # Both modes hand the inner optimizer the same weighted mean up to float32
        # rounding (about 1e-7 relative); its step is at most eta (FedAdam) or the mean
        # itself (FedAvgM's first step), so results agree far inside 1e-5.
        assert np.max(np.abs(per_client[name] - pre[name])) < 1e-5


CODEC_SPECS = [
    {"name": "fp16"},
    {"name": "bf16"},
    {"name": "uniform", "bits": 4, "block": 128},
    {"name": "qsgd", "levels": 8, "block": 512},
    {"name": "sign", "block": 256},
    {"name": "topk", "fraction": 0.05},
    {"name": "randk", "fraction": 0.05},
    {"name": "ef", "inner": "sign", "block": 256},
    {"name": "ef", "inner": "topk", "fraction": 0.05},
    {"name": "subsample", "inner": "eden", "fraction": 0.25, "bits": 1},
    {"name": "residual", "inner": {"name": "subsample", "inner": "qsgd", "fraction": 0.5}},
]


@pytest.mark.parametrize("spec", CODEC_SPECS, ids=lambda s: "-".join(codec_chain(s)))
def test_every_codec_through_the_mod_and_the_wrapper(spec: dict) -> None:
    settings = settings_from_dict(
        {"num_clients": N, "num_rounds": 1, "fraction_evaluate": 0.0, "codec": spec}
    )
    arrays, strategy, grid, spy = one_round(settings)
    record = strategy.rounds[0]
    assert (record["replied"], record["failures"]) == (N, 0)
    replies = _train_only(grid.replies)
    if spec["name"] != "ef":
        # The client-reported codec error, recomputed here from the real payloads and the
        # spied update (trained - received; the instruction carried the initial model).
        initial0 = {k: np.asarray(v.numpy()) for k, v in _initial(settings).items()}
        for reply in replies:
            sid = int(reply_header(reply.content)[KEY_STABLE_ID])
            num = den = 0.0
            for name, data in _payloads(reply).items():
                x = (spy.local[sid][name] - initial0[name]).astype(np.float64)
                y = decode_bytes(data).numpy().astype(np.float64)
                num += float(((y - x) ** 2).sum())
                den += float((x**2).sum())
            row = next(r for r in record["per_client"] if r["client"] == sid)
            assert row["codec_rel_error"] == pytest.approx(num / den, rel=1e-9)
            # n / k times the kept share's error: random-k at 5%, a quarter under EDEN
            bound = {"randk": 40.0, "subsample": 4 * 1.6}.get(spec["name"], 2.0)
            assert 0 < row["codec_rel_error"] < bound
    rows = {row["client"]: row for row in record["per_client"]}
    initial = {k: np.asarray(v.numpy()) for k, v in _initial(settings).items()}
    for reply in replies:
        sid = int(reply_header(reply.content)[KEY_STABLE_ID])
        payloads = _payloads(reply)
        # each payload as a compact entry: its header (fixed part and shape) is one byte
        assert rows[sid]["uplink_codec_bytes"] == sum(
            len(p) - HEADER_FIXED_BYTES - 4 * initial[n].ndim + 1 for n, p in payloads.items()
        )
        # Policy: a tensor is compressed exactly when its codec's payload is shorter
        # than raw (fedcomp.codecs.policy; tests/test_tensor_policy.py): the digits
        # MLP's 10 output biases travel raw (codec id 0) under every codec here.
        for name, data in payloads.items():
            raw_len = HEADER_FIXED_BYTES + 4 * initial[name].ndim + initial[name].nbytes
            if data[3] == 0:
                assert len(data) == raw_len, name
            else:
                assert len(data) < raw_len, name
        assert payloads["5.bias"][3] == 0 and payloads["1.weight"][3] != 0
    memory = spec["name"] in ("ef", "residual")
    expected = codec_chain(spec)[1] if memory else spec["name"]
    assert record["codec"]["per_tensor"]["1.weight"] == expected
    # Compression that is not the identity must move the model, and stay finite.
    assert all(np.isfinite(v).all() for v in arrays.values())
    assert any(not np.array_equal(arrays[k], initial[k]) for k in arrays)
    # The fp32 reference, computed from the layout: a compact entry's byte + float32
    # values per tensor (integer buffers travel raw in their own dtype), once per
    # decoded reply.
    fp32_one = sum(
        1 + (4 if a.dtype.kind == "f" else a.itemsize) * a.size for a in initial.values()
    )
    sent = sum(
        len(p) - HEADER_FIXED_BYTES - 4 * initial[n].ndim + 1
        for r in replies
        for n, p in _payloads(r).items()
    )
    assert record["codec"]["fp32_codec_bytes"] == fp32_one * len(replies)
    assert record["codec"]["decoded_codec_bytes"] == sent < fp32_one * len(replies)


def test_flower_client_side_dp_stacks_in_per_client_mode() -> None:
    from flwr.clientapp.mod import fixedclipping_mod
    from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping

    settings = settings_from_dict({"num_clients": N, "num_rounds": 1, "fraction_evaluate": 0.0})
    clipping = 0.05
    inner = DifferentialPrivacyClientSideFixedClipping(
        make_inner_strategy({"name": "fedavg"}, N),
        noise_multiplier=0.0,
        clipping_norm=clipping,
        num_sampled_clients=N,
    )
    spy = Spy()
    # Spy inside the clipping mod: it sees the unclipped model; the compression mod
    # (outermost) encodes the clipped one.
    grid = InProcessGrid(make_client_app(inner_mods=[fixedclipping_mod, spy]), N)
    strategy = CompressedStrategy(
        inner,
        codec={"name": "fp32"},
        run_seed=0,
        options=ServerOptions(task=client_task(settings), identity=IdentityOptions(timeout=5)),
    )
    strategy.start(grid, _initial(settings), num_rounds=1)
    assert strategy.rounds[0]["replied"] == N
    for reply in _train_only(grid.replies):
        norm = math.sqrt(
            sum(float((decode_bytes(p).double() ** 2).sum()) for p in _payloads(reply).values())
        )
        assert norm <= clipping * (1 + 1e-5)  # fp32 keeps the clipping bound


def test_a_diverged_global_model_is_recorded_then_fails_the_run(tmp_path, monkeypatch) -> None:
    """A central loss that stops being finite: the round records it as unavailable, the
    round line says DIVERGED, results.json is still written, and the run fails."""
    import strategies.server_app as server_app
    from fedcomp.failures import RunFailed
    from fedcomp.results_file import load_results

    real = server_app.make_evaluate_fn

    def diverging(settings):
        evaluate = real(settings)

        def fn(server_round, arrays):
            metrics = evaluate(server_round, arrays)
            if server_round >= 2:
                metrics["loss"] = float("nan")
            return metrics

        return fn

    monkeypatch.setattr(server_app, "make_evaluate_fn", diverging)
    settings = settings_from_dict(
        {"num_clients": N, "num_rounds": 3, "results_path": str(tmp_path / "results.json")}
    )
    with pytest.raises(RunFailed, match="diverged: its central loss became non-finite at round 2"):
        run_server(InProcessGrid(make_client_app(), N), settings)
    rounds = load_results(tmp_path / "results.json")["rounds"]
    assert [r["loss"] is None for r in rounds] == [False, True, True]
    assert [r.get("nonfinite_metrics") for r in rounds] == [None, ["loss"], ["loss"]]
    assert all(r["accuracy"] is not None for r in rounds)


def test_round_lines_reach_the_console_of_an_app_that_configured_no_logging() -> None:
    """A plain Flower app configures only Flower's logger: fedcomp's round lines and
    warnings must still be printed, through Flower's own handlers."""
    import subprocess
    import sys

    code = (
        "from experiments.inprocess import InProcessGrid, initial_arrays, set_task_identity\n"
        "from clients.client_app import make_client_app\n"
        "from fedcomp.flower import CompressedStrategy, ServerOptions\n"
        "from fedcomp.settings import settings_from_dict\n"
        "from strategies.inner import make_inner_strategy\n"
        "from strategies.server_app import client_task\n"
        "set_task_identity()\n"
        "s = settings_from_dict({'num_clients': 2, 'num_rounds': 1})\n"
        "w = CompressedStrategy(make_inner_strategy({'name': 'fedavg'}, 2),\n"
        "    codec={'name': 'uniform', 'bits': 4}, options=ServerOptions(task=client_task(s)))\n"
        "w.start(InProcessGrid(make_client_app(), 2), initial_arrays(s), num_rounds=1)\n"
        "assert len(w.rounds) == 1\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    lines = out.stdout + out.stderr
    assert "CompressedStrategy: codec" in lines and "run seed 0" in lines
    assert "round 1/1 | accuracy n/a" in lines and "total wire" in lines


def test_a_client_app_without_the_mod_is_named_on_the_first_round() -> None:
    """A plain Flower ClientApp (a train handler, no query handler, no mod): the
    identity message reaches its train handler, which fails; the run stops before
    round 1 with an error that names the missing mod and the handler's own error."""
    from flwr.clientapp import ClientApp

    from fedcomp.failures import RunFailed

    plain = ClientApp()

    @plain.train()
    def train(msg, context):
        arrays = msg.content["arrays"]  # a quickstart handler: the model, or KeyError
        return Message(RecordDict({"arrays": arrays}), reply_to=msg)

    strategy = CompressedStrategy(
        make_inner_strategy({"name": "fedavg"}, 2),
        codec={"name": "fp32"},
        options=ServerOptions(identity=IdentityOptions(timeout=5)),
    )
    with pytest.raises(RunFailed, match=r"CompressionMod\(\)\]\).*First error: .*arrays"):
        strategy.start(InProcessGrid(plain, 2), _initial(SETTINGS), num_rounds=1)
    assert strategy.rounds == []


def test_two_nodes_claiming_one_stable_id_are_refused_loudly(caplog) -> None:
    """Two connected nodes with the same partition id: the second is refused (never
    sampled) with a message naming the node config; the run goes on with the rest."""
    grid = InProcessGrid(make_client_app(), N)
    nodes = list(grid.contexts)
    original, twin = nodes[0], nodes[-1]
    grid.contexts[twin].node_config["partition-id"] = 0
    strategy = CompressedStrategy(
        make_inner_strategy({"name": "fedavg"}, N, fraction_evaluate=0.0),
        codec={"name": "fp32"},
        options=ServerOptions(task=client_task(SETTINGS), identity=IdentityOptions(timeout=5)),
    )
    caplog.set_level(logging.ERROR, logger="fedcomp.flower.identity")
    strategy.start(grid, _initial(SETTINGS), num_rounds=1)
    assert any("both claim stable id 0" in m and "partition-id" in m for m in caplog.messages)
    (refused,) = strategy.clients.ids.refused  # the twin that answered second
    assert refused in (twin, original)
    assert strategy.clients.ids.stable_ids() == list(range(N - 1))
    assert strategy.rounds[0]["replied"] == N - 1


@pytest.mark.parametrize(("min_numel", "expected"), [(0, "uniform"), (10**7, "raw")])
def test_the_policy_threshold_from_the_settings_reaches_the_clients(min_numel, expected) -> None:
    """``policy.min_numel`` travels to every client: 0 compresses every tensor the codec
    carries in fewer bytes (all but the 10 output biases: 40 B raw, 67 B in 2-bit
    codes), a threshold above the model's largest tensor sends all of them raw, whose
    bytes are then exactly fp32's."""
    settings = settings_from_dict(
        {
            "num_clients": N,
            "num_rounds": 1,
            "fraction_evaluate": 0.0,
            "codec": {"name": "uniform", "bits": 2, "block": 64},
            "policy": {"min_numel": min_numel},
            "train": {"local_epochs": 1},
        }
    )
    (record,) = run_server(InProcessGrid(make_client_app(), N), settings)["rounds"]
    per_tensor = dict(record["codec"]["per_tensor"])
    assert per_tensor.pop("5.bias") == "raw"
    assert set(per_tensor.values()) == {expected}
    assert len(record["codec"]["per_tensor"]) == len(
        list(build_model(settings.model, "digits", 0).state_dict())
    )
    if expected == "raw":
        assert record["codec"]["fp32_codec_bytes"] == record["uplink_codec_bytes"]


def _live_update_peak(monkeypatch, handoff: str, n: int = 12, **trees) -> int:
    """The most decoded updates alive at once while the server takes a round: each
    decode's largest array is watched with a weak reference until it is freed."""
    from fedcomp.flower.families import stateless

    peak = _watch_live(monkeypatch, stateless, "decode_payloads")
    settings = settings_from_dict(
        {
            "num_clients": n,
            "num_rounds": 1,
            "fraction_evaluate": 0.0,
            "codec": {"name": "uniform", "bits": 4, "block": 64},
            "aggregation": {"handoff": handoff, "norm_cap": 2.0, **trees},
            "train": {"local_epochs": 1},
        }
    )
    ids = [10_000 + i for i in range(n)]
    run_server(InProcessGrid(make_client_app(), n, node_ids=ids), settings)
    return peak[0]


def _watch_live(monkeypatch, owner, name: str) -> list[int]:
    """Wrap ``owner.name`` (returning ``(arrays, ...)``) so that the largest array of
    each call is watched with a weak reference until freed; returns a one-element list
    that holds the most alive at once."""
    import weakref

    live, peak = [0], [0]
    original = getattr(owner, name)

    def watched(*args, **kwargs):
        out = original(*args, **kwargs)
        biggest = max(out[0].values(), key=lambda a: a.size)
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        weakref.finalize(biggest, lambda: live.__setitem__(0, live[0] - 1))
        return out

    monkeypatch.setattr(owner, name, watched)
    return peak


@pytest.mark.parametrize(
    "trees",
    [{}, {"tree": "balanced"}, {"tree": "adaptive", "dtype": "bf16", "root_fp32": True}],
    ids=["plain", "balanced", "adaptive_bf16"],
)
def test_the_pre_aggregated_mean_keeps_at_most_two_decoded_updates_alive(
    monkeypatch, trees
) -> None:
    """Streaming: each update is released once its norm is known and decoded again when
    the mean or the trees add it (and once more for the moments adaptive trees are
    chosen from), so two are alive at most; the per-client hand-off, which must hand
    the inner strategy every update, holds all of them (what the test would see if the
    mean kept a list)."""
    assert _live_update_peak(monkeypatch, "pre_aggregated", **trees) <= 2
    if not trees:
        assert _live_update_peak(monkeypatch, "per_client") == 12


def _plain_mean_round(monkeypatch, *, second_pass=False, order=None, **aggregation):
    """The second of two streaming plain-mean rounds (the first sets the reference
    the trust region's consensus is summed with while decoding): its record, the mean
    update and the number of payload decodes in it. ``second_pass``: refuse the sum
    taken during the first decode."""
    from fedcomp.flower import handoff, round_state
    from fedcomp.flower.families import stateless

    n, decodes, means = 8, [0], []
    original = stateless.decode_payloads

    def counted(*args, **kwargs):
        decodes[0] += kwargs["server_round"] == 2
        return original(*args, **kwargs)

    real_mean = handoff.PlainMean.mean

    def kept(self, decoded, state):
        means.append(real_mean(self, decoded, state))
        return means[-1]

    monkeypatch.setattr(stateless, "decode_payloads", counted)
    monkeypatch.setattr(handoff.PlainMean, "mean", kept)
    if second_pass:
        monkeypatch.setattr(round_state.Presum, "matches", lambda self, decoded: False)
    settings = settings_from_dict(
        {
            "num_clients": n,
            "num_rounds": 2,
            "fraction_evaluate": 0.0,
            "codec": {"name": "uniform", "bits": 4, "block": 64},
            "aggregation": {"handoff": "pre_aggregated", **aggregation},
            "train": {"local_epochs": 1},
        }
    )
    grid = InProcessGrid(make_client_app(), n, node_ids=[10_000 + i for i in range(n)], order=order)
    _, record = run_server(grid, settings)["rounds"]
    monkeypatch.undo()
    return record, means[1], decodes[0]


def test_the_streaming_mean_decodes_each_reply_once_and_equals_the_second_pass(
    monkeypatch,
) -> None:
    """The plain mean is summed while the replies are first decoded; with every reply
    accepted unchanged that sum is used: each payload decoded once, and the mean the
    same to the last bit as the second pass would give, whatever the reply order."""
    record, mean, decodes = _plain_mean_round(monkeypatch)
    # Loaded again: only the contributions the trust region's norm screen could not
    # place (fedcomp.flower.bounds); the consensus itself was summed while decoding.
    again = record["codec"].get("consensus_loads", 0)
    assert record["replied"] == 8 and decodes == 8 + again and again < 8
    assert record["codec"]["decode_passes"] == 1
    record2, mean2, decodes2 = _plain_mean_round(monkeypatch, second_pass=True)
    assert decodes2 == 16 + again and record2["codec"]["decode_passes"] == 2
    _, mean3, _ = _plain_mean_round(monkeypatch, order=lambda replies: replies[::-1])
    assert mean.keys() == mean2.keys() == mean3.keys()
    for name in mean:
        assert np.array_equal(mean[name], mean2[name]), name
        assert np.array_equal(mean[name], mean3[name]), name


def test_a_clipped_update_makes_the_streaming_mean_sum_again(monkeypatch) -> None:
    """Clipping changes an update after its first decode: the early sum is not the
    mean of what was accepted, so it is discarded and the replies decoded again."""
    record, _, decodes = _plain_mean_round(monkeypatch, norm_cap=1.0)
    assert record["clipped"] > 0
    again = record["codec"].get("consensus_loads", 0)
    assert record["codec"]["decode_passes"] == 2 and decodes == 16 + again


RESIDUAL = {"name": "residual", "inner": "uniform", "bits": 2, "block": 64}


def _residual_rounds(monkeypatch, *, handoff="pre_aggregated", second_pass=False, rounds=3):
    """Residual rounds with every update the control variates reconstruct (ghat)
    watched until freed: the records and the most alive at once."""
    from fedcomp.controlvariates import ControlVariateServer
    from fedcomp.flower import round_state

    peak = _watch_live(monkeypatch, ControlVariateServer, "prepare")
    if second_pass:
        monkeypatch.setattr(round_state.Presum, "matches", lambda self, decoded: False)
    n = 8
    settings = settings_from_dict(
        {
            "num_clients": n,
            "num_rounds": rounds,
            "fraction_evaluate": 0.0,
            "codec": RESIDUAL,
            "aggregation": {"handoff": handoff},
            "train": {"local_epochs": 1},
        }
    )
    grid = InProcessGrid(make_client_app(), n, node_ids=[10_000 + i for i in range(n)])
    records = run_server(grid, settings)["rounds"]
    monkeypatch.undo()
    return records, peak[0]


def test_residual_compression_streams_and_its_mirrors_stay_in_step(monkeypatch) -> None:
    """Residual replies are released like any other in the pre-aggregated hand-off:
    at most two reconstructed updates alive (the per-client hand-off holds all eight);
    the mirrors move after the mean, from the payload decoded once more, and stay in
    step with the clients (no resync ever requested: each client's checksum of its
    state matched the server's mirror every round); and the mean taken during the
    first decode equals the second pass bit for bit, round after round."""
    records, peak = _residual_rounds(monkeypatch)
    assert peak <= 2
    assert all(r["replied"] == 8 and r["codec"]["resync_requests"] == 0 for r in records)
    assert all(r["codec"]["decode_passes"] == 1 for r in records)
    again, _ = _residual_rounds(monkeypatch, second_pass=True)
    assert all(r["codec"]["decode_passes"] == 2 for r in again)
    assert [r["accuracy"] for r in again] == [r["accuracy"] for r in records]
    assert [r["loss"] for r in again] == [r["loss"] for r in records]
    _, per_client_peak = _residual_rounds(monkeypatch, handoff="per_client", rounds=1)
    assert per_client_peak == 8
