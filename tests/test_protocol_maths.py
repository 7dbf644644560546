"""The protocols' formulas against direct computation, round after round.

- Residual compression through the real mod and wrapper: the server's reconstruction
  ghat_m = h_m + decode(q_m) (decoded here from the payload bytes), the new global
  model as initial + the num-examples weighted mean of those reconstructions, and the
  mirror update h_m <- h_m + alpha decode(q_m) with alpha = 1 / (1 + omega) derived here
  from the inner codec's definition, bit-identical on client and server.
- The one-bit code in round 2 with ``center="previous"``: the server's mean is the
  library decoder run here on the same payloads with last round's aggregate as the side
  center (and not the decode around zero); tau follows the median of the clients'
  scale codes, recomputed here from the clients' own updates.
- Reduction-tree statistics: exponential moving moments per client and chunk, and the
  trees chosen again only on refresh rounds or when the client set changes.
- The downlink's replica versions, step history and catch-up steps.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message

from clients.client_app import make_client_app
from experiments.inprocess import InProcessGrid, Spy, initial_arrays
from fedcomp.codecs import TensorPolicy, decode_bytes, make_codec, parse_payload
from fedcomp.codecs.residual import SYNC_NORMAL, SYNC_RESTART
from fedcomp.downlink import BroadcastServer, parse_downlink
from fedcomp.flower.families.joint import joint_names
from fedcomp.flower.memory_state import load_memory
from fedcomp.flower.options import IdentityOptions, ServerOptions
from fedcomp.flower.packed import opened
from fedcomp.flower.reply_format import metrics_of, reply_header
from fedcomp.flower.strategy import CompressedStrategy
from fedcomp.flower.validation import sent_payloads
from fedcomp.handoff_options import Aggregation
from fedcomp.keys import (
    KEY_CV_VERSION,
    KEY_JOINT_CLIENTS,
    KEY_JOINT_INDEX,
    KEY_JOINT_TAU,
    KEY_NUM_EXAMPLES,
    KEY_RESYNC,
    KEY_STABLE_ID,
)
from fedcomp.onebit import OneBitCode
from fedcomp.onebit.federated import joint_seed, unpack_taus
from fedcomp.settings import Settings, settings_from_dict
from fedcomp.trees import huffman_tree
from fedcomp.trees.aggregate import TreeConfig, TreeStats
from fedcomp.trees.stream import streaming_tree_mean
from strategies.inner import make_inner_strategy
from strategies.server_app import client_task

U32 = 2.0**-24  # unit roundoff of float32
#: A small model keeps every in-process round cheap: 64 -> 32 -> 10 on digits.
SMALL_MODEL = {"name": "mlp", "hidden": [32]}


def _settings(codec: dict, clients: int, **extra) -> Settings:
    return settings_from_dict(
        {
            "num_clients": clients,
            "fraction_evaluate": 0.0,
            "codec": codec,
            "model": SMALL_MODEL,
            "train": {"local_epochs": 1},
            "dataset": {"name": "digits", "num_samples": 600},
            **extra,
        }
    )


class Rounds:
    """Everything one run's rounds saw, captured around the wrapper's public methods:
    the global model each round started from, the replies the wrapper got, the mirrors
    before and after, what the inner strategy was handed and what it returned."""

    def __init__(
        self, strategy: CompressedStrategy, grid: InProcessGrid, spy: Spy | None = None
    ) -> None:
        self.globals: list[dict[str, np.ndarray]] = []
        self.sent: list[dict[int, Message]] = []  # node id -> train instruction
        self.replies: list[list[Message]] = []
        self.mirrors_before: list[dict[int, tuple[int, dict[str, np.ndarray]]]] = []
        self.mirrors_after: list[dict[int, tuple[int, dict[str, np.ndarray]]]] = []
        self.clients_after: list[dict[int, tuple[int, dict[str, np.ndarray]]]] = []
        self.inner_in: list[list[dict[str, np.ndarray]]] = []
        self.results: list[dict[str, np.ndarray]] = []
        #: partition id -> the dense model it trained, per round (with a spy).
        self.local: list[dict[int, dict[str, np.ndarray]]] = []
        configure, aggregate = strategy.configure_train, strategy.aggregate_train
        inner = strategy.strategy.aggregate_train

        def mirrors() -> dict[int, tuple[int, dict[str, np.ndarray]]]:
            if strategy.uplink.cv is None:
                return {}
            store = strategy.uplink.cv.store
            return {
                sid: (m.version, {k: v.copy() for k, v in m.arrays.items()})
                for sid in store.ids()
                if (m := store.get(sid)) is not None
            }

        def configure_train(server_round, arrays, config, grid_):
            self.globals.append({k: np.array(v.numpy()) for k, v in arrays.items()})
            messages = list(configure(server_round, arrays, config, grid_))
            self.sent.append({m.metadata.dst_node_id: m for m in messages})
            return messages

        def aggregate_train(server_round, replies):
            replies = list(replies)
            self.replies.append(replies)
            if spy is not None:
                self.local.append(dict(spy.local))
                spy.local = {}
            self.mirrors_before.append(mirrors())
            out = aggregate(server_round, replies)
            self.mirrors_after.append(mirrors())
            clients = {}
            for node_id, context in grid.contexts.items():
                memory = load_memory(context.state)
                clients[grid.partition_of(node_id)] = (memory.pending_version, memory.pending)
            self.clients_after.append(clients)
            kept = out[0] is None  # no valid reply, or the model was kept
            self.results.append({} if kept else {k: np.array(v.numpy()) for k, v in out[0].items()})
            return out

        def inner_aggregate(server_round, replies):
            replies = list(replies)
            self.inner_in.append(
                [{k: np.array(v.numpy()) for k, v in r.content["arrays"].items()} for r in replies]
            )
            return inner(server_round, replies)

        strategy.configure_train = configure_train  # type: ignore[method-assign]
        strategy.aggregate_train = aggregate_train  # type: ignore[method-assign]
        strategy.strategy.aggregate_train = inner_aggregate  # type: ignore[method-assign]


def _run(settings: Settings, rounds: int, handoff: str, spy: Spy | None = None):
    grid = InProcessGrid(make_client_app(inner_mods=[spy] if spy else None), settings.num_clients)
    strategy = CompressedStrategy(
        make_inner_strategy({"name": "fedavg"}, settings.num_clients, fraction_evaluate=0.0),
        codec=settings.codec,
        run_seed=settings.seed,
        options=ServerOptions(
            aggregation=Aggregation(handoff=handoff),
            task=client_task(settings),
            identity=IdentityOptions(timeout=5),
        ),
    )
    seen = Rounds(strategy, grid, spy)
    strategy.start(grid, initial_arrays(settings), num_rounds=rounds)
    return strategy, seen


def _sid_weight(reply: Message) -> tuple[int, float]:
    header = reply_header(reply.content)
    return int(header[KEY_STABLE_ID]), float(metrics_of(header)[KEY_NUM_EXAMPLES])


# ------------------------------------------------------------------------- residual

RES_BITS, RES_BLOCK = 2, 64
RESIDUAL = {"name": "residual", "inner": "uniform", "bits": RES_BITS, "block": RES_BLOCK}
RES_CLIENTS, RES_ROUNDS = 4, 3


def test_residual_reconstruction_mean_and_mirror_update_follow_their_definitions() -> None:
    settings = _settings(RESIDUAL, RES_CLIENTS)
    strategy, seen = _run(settings, RES_ROUNDS, "per_client")
    assert [r["replied"] for r in strategy.rounds] == [RES_CLIENTS] * RES_ROUNDS

    # omega from the definition of stochastic uniform rounding (block B, b bits): a
    # coordinate on a grid of step 2 s / (2^b - 1), s = max |x| over its block, has
    # variance at most step^2 / 4, so a block's noise is at most
    # B s^2 / (2^b - 1)^2 <= B / (2^b - 1)^2 ||x_block||^2, B the block's size: a
    # tensor of n < RES_BLOCK elements is one block of n.
    def alpha_of(numel: int) -> float:
        return 1.0 / (1.0 + min(RES_BLOCK, numel) / (2**RES_BITS - 1) ** 2)

    uniform_id = make_codec("uniform", bits=RES_BITS, block=RES_BLOCK).codec_id
    covered_seen: set[str] = set()
    for t in range(RES_ROUNDS):
        glob, before, after = seen.globals[t], seen.mirrors_before[t], seen.mirrors_after[t]
        ghats: dict[int, dict[str, np.ndarray]] = {}
        weights: dict[int, float] = {}
        for reply in seen.replies[t]:
            sid, weights[sid] = _sid_weight(reply)
            header = reply_header(reply.content)
            payloads = sent_payloads(header, glob, settings.seed)
            # Round 1: no state anywhere, a restart from h = 0 (bootstrap "zero"); then
            # a normal reply against the mirror of the version the header states.
            if t == 0:
                assert sid not in before and int(header[KEY_RESYNC]) == SYNC_RESTART
            else:
                assert int(header[KEY_RESYNC]) == SYNC_NORMAL
                assert int(header[KEY_CV_VERSION]) == before[sid][0] == t
            ghats[sid], moved = {}, {}
            for name, g in glob.items():
                buf = bytes(payloads[name])
                r_hat = decode_bytes(buf).numpy()
                if parse_payload(buf).header.codec_id != uniform_id:  # raw: the update
                    ghats[sid][name] = r_hat
                    continue
                covered_seen.add(name)
                h = before[sid][1][name] if t else np.zeros_like(g)
                # One float32 addition has exactly one correctly rounded result.
                ghats[sid][name] = h + r_hat
                # h + alpha r_hat: alpha rounded to float32, the product and the sum
                # each rounded once: at most 3u (|h| + alpha |r_hat|) from the real value.
                alpha = alpha_of(g.size)
                exact = h.astype(np.float64) + alpha * r_hat.astype(np.float64)
                bound = 3 * U32 * (np.abs(h) + alpha * np.abs(r_hat)) + np.finfo(np.float32).tiny
                got = after[sid][1][name]
                assert got.dtype == np.float32
                err = np.abs(got - exact)
                assert (err <= bound).all(), (t, sid, name, float(np.max(err / bound)))
                moved[name] = got
            # The mirror moved to the next version, the client's own h bit for bit.
            version, client = seen.clients_after[t][sid]
            assert after[sid][0] == version == t + 1
            assert set(client) == set(moved)
            assert all(np.array_equal(client[k], moved[k]) for k in moved), (t, sid)
        # The inner strategy got global + ghat_m per client, in stable-id order.
        order = sorted(ghats)
        assert len(seen.inner_in[t]) == len(order) == RES_CLIENTS
        for sid, arrays in zip(order, seen.inner_in[t], strict=True):
            for name, g in glob.items():
                assert np.array_equal(arrays[name], g + ghats[sid][name]), (t, sid, name)
        # The new global model: global + the num-examples weighted mean of the ghat_m,
        # against a float64 reference. Budget as for the fp32 pipeline: global + ghat
        # rounded once per client, a k-term weighted float32 sum ((k + 1) u), relative
        # to sum_m f_m |x_m| and |global|.
        w = np.array([weights[s] for s in order])
        factors = w / w.sum()
        for name, g in glob.items():
            g64 = g.astype(np.float64)
            stack = np.stack([ghats[s][name].astype(np.float64) for s in order])
            reference = g64 + np.tensordot(factors, stack, axes=1)
            scale = np.tensordot(factors, np.abs(g64 + stack), axes=1) + np.abs(g64)
            bound = (RES_CLIENTS + 3) * U32 * scale + np.finfo(np.float32).tiny
            err = np.abs(seen.results[t][name].astype(np.float64) - reference)
            assert (err <= bound).all(), (t, name, float(np.max(err / bound)))
    # Not vacuous: three tensors under the control variate (one of them smaller than a
    # block: 1.bias), clients of unequal weight.
    assert covered_seen == {"1.weight", "1.bias", "3.weight"}
    assert seen.globals[0]["1.bias"].size < RES_BLOCK
    assert len(set(weights.values())) > 1


# ------------------------------------------------------------------------- one-bit

ONEBIT = {"name": "onebit", "bits": 2, "center": "previous", "tau_prior": 0.003, "block": 512}
OB_CLIENTS, OB_ROUNDS = 6, 3


def _expected_tau(deltas: list[np.ndarray], block: int, previous: np.ndarray) -> np.ndarray:
    """Next round's tau per block from its definition (docs/onebit.md): each client's
    robust spread 1.4826 median |x - median x| per block, sent as an 8-bit code of
    4 steps per octave around 2^0 (code 128; 0 for a zero spread); the median over
    clients of the spreads the codes stand for; at most 4x away from the previous tau;
    a block where every client's spread is zero keeps it. float32 on the wire."""
    values = []
    for x in deltas:
        x = x.astype(np.float64).reshape(-1)
        row = []
        for lo in range(0, x.size, block):
            part = x[lo : lo + block]
            spread = 1.4826 * np.median(np.abs(part - np.median(part)))
            code = 0 if spread == 0 else min(max(round(4 * np.log2(spread)) + 128, 1), 255)
            row.append(0.0 if code == 0 else 2.0 ** ((code - 128) / 4))
        values.append(row)
    median = np.median(np.array(values), axis=0)
    tau = np.clip(np.where(median > 0, median, previous), previous / 4, previous * 4)
    return tau.astype(np.float32).astype(np.float64)


def test_onebit_later_rounds_decode_around_the_previous_aggregate_and_tau_follows_the_codes():
    settings = _settings(
        ONEBIT,
        OB_CLIENTS,
        aggregation={"handoff": "pre_aggregated"},
        regime_check=False,  # a few clients: the protocol, not the accuracy
    )
    spy = Spy()
    strategy, seen = _run(settings, OB_ROUNDS, "pre_aggregated", spy=spy)
    assert [r["replied"] for r in strategy.rounds] == [OB_CLIENTS] * OB_ROUNDS
    code = OneBitCode(**{k: v for k, v in ONEBIT.items() if k != "name"})
    names = joint_names(code, TensorPolicy(), seen.globals[0])
    assert len(names) == 2  # both weight matrices; the biases travel raw
    blocks = [code.num_blocks(seen.globals[0][n].size) for n in names]
    assert blocks[0] > 1  # several tau blocks
    center = {n: np.zeros(seen.globals[0][n].size) for n in names}  # round 1: none yet
    prior = np.float64(np.float32(ONEBIT["tau_prior"]))  # tau travels as float32
    tau = {n: np.full(b, prior) for n, b in zip(names, blocks, strict=True)}
    inside_clip = 0
    for t in range(OB_ROUNDS):
        glob = seen.globals[t]
        plans = {}
        for reply in seen.replies[t]:
            config = opened(seen.sent[t][reply.metadata.src_node_id].content["config"])
            sent_taus = unpack_taus(config[KEY_JOINT_TAU], blocks)
            for name, sent in zip(names, sent_taus, strict=True):
                assert np.array_equal(sent, tau[name]), (t, name)
            sid, weight = _sid_weight(reply)
            plans[sid] = (int(config[KEY_JOINT_INDEX]), weight, int(config[KEY_JOINT_CLIENTS]))
        sids = sorted(plans)
        (handed,) = seen.inner_in[t]  # one pre-aggregated reply
        for name in names:
            payloads = [
                bytes(sent_payloads(reply_header(r.content), seen.globals[t], settings.seed)[name])
                for r in sorted(seen.replies[t], key=lambda r: _sid_weight(r)[0])
            ]
            common = {
                "client_indices": [plans[s][0] for s in sids],
                "num_clients": plans[sids[0]][2],
                "seed": joint_seed(settings.seed, t + 1, name),
                "tau": tau[name],
                "shape": glob[name].shape,
                "weights": [plans[s][1] for s in sids],
            }
            mean = code.decode_mean(payloads, side_center=center[name], **common).numpy()
            # The same decoder on the same bits: global + mean is one float32 addition.
            assert np.array_equal(handed[name], glob[name] + mean), (t, name)
            if t:  # the side center matters: decoding around zero gives another mean
                around_zero = code.decode_mean(
                    payloads, side_center=np.zeros(mean.size), **common
                ).numpy()
                assert np.max(np.abs(around_zero - mean)) > 1e3 * np.max(np.spacing(mean))
            center[name] = mean.astype(np.float64).reshape(-1)
            # Next round's tau from the clients' own updates (the spy's trained models).
            deltas = [seen.local[t][pid][name] - glob[name] for pid in range(OB_CLIENTS)]
            new_tau = _expected_tau(deltas, ONEBIT["block"], tau[name])
            inside_clip += int(np.sum((new_tau > tau[name] / 4) & (new_tau < tau[name] * 4)))
            tau[name] = new_tau
    # The last round's median moved the server's state (checked against the next
    # round's instructions above for the earlier rounds).
    for name in names:
        planned = strategy.uplink.joint_state.taus[name].astype(np.float32)  # as it will travel
        assert np.array_equal(planned.astype(np.float64), tau[name])
        assert np.array_equal(strategy.uplink.joint_state.centers[name], center[name])
    assert inside_clip > 0  # some tau set by the median itself, not by the 4x clip


# ------------------------------------------------------------------------- trees

TREE_CLIENTS, TREE_ROUNDS, REFRESH, DECAY, CHUNK = 5, 7, 3, 0.75, 64
#: Round -> the stable ids that reply: client 2 misses round 5, client 4 round 6 (as
#: many clients as in round 5, another set), all of them otherwise.
TREE_PARTICIPANTS = {
    t: {5: [0, 1, 3, 4], 6: [0, 1, 2, 3]}.get(t, list(range(TREE_CLIENTS)))
    for t in range(1, TREE_ROUNDS + 1)
}


def test_tree_statistics_are_moving_averages_and_trees_change_only_on_refresh_or_new_sets():
    """aggregation.stats=ema: per client and chunk, m <- d m + (1 - d) m_t and
    q <- d q + (1 - d) q_t over the rounds it takes part in (its first observation
    taken as is), m_t, q_t the mean and mean square of its leaf (w_i / W) x_i on that
    chunk; a statistics tree (huffman) is chosen from var = max(q - m^2, eps) on rounds
    t with (t - 1) % R == 0 and whenever the set of clients differs from the one the
    tree was chosen for; in between the tree is kept."""
    config = TreeConfig(
        tree="huffman", stats="ema", ema_decay=DECAY, refresh_rounds=REFRESH, chunk_size=CHUNK
    )
    stats = TreeStats()
    rng = np.random.default_rng(5)
    shapes = {"w": (2, CHUNK), "b": (40,)}  # two full chunks, one partial
    chunks = {"w": 2, "b": 1}
    moments: dict[tuple[int, str, int], tuple[float, float, float]] = {}  # m, q, E|leaf|
    chosen: dict[tuple[str, int], tuple[tuple[int, ...], object]] = {}
    kept_although_stats_moved = rechosen_on_refresh = rechosen_for_new_set = 0
    for t in range(1, TREE_ROUNDS + 1):
        sids = TREE_PARTICIPANTS[t]
        # Spreads over six decades, shuffled each round: the variance ranking moves.
        scales = 10.0 ** rng.permutation(np.linspace(-3, 3, len(sids)))
        updates = [
            {
                n: (0.1 * s * rng.standard_normal(shape)).astype(np.float32)
                for n, shape in shapes.items()
            }
            for s in scales
        ]
        weights = rng.uniform(1, 50, len(sids)).round()
        streaming_tree_mean([lambda u=u: u for u in updates], list(weights), sids, config, stats, t)
        factors = weights / weights.sum()
        refresh = (t - 1) % REFRESH == 0
        for name, count in chunks.items():
            for c in range(count):
                for sid, u, f in zip(sids, updates, factors, strict=True):
                    leaf = f * u[name].astype(np.float64).reshape(-1)[c * CHUNK : (c + 1) * CHUNK]
                    new = (leaf.mean(), (leaf**2).mean(), np.abs(leaf).mean())
                    old = moments.get((sid, name, c))
                    moments[(sid, name, c)] = (
                        new
                        if old is None
                        else tuple(
                            DECAY * o + (1 - DECAY) * n for o, n in zip(old, new, strict=True)
                        )
                    )
                    m, q, a = moments[(sid, name, c)]
                    # The leaf as the server forms it is f x_i rounded to float32 (f
                    # itself rounded, then the product): within 2u |leaf| per element,
                    # so 2u E|leaf| for the mean and 4u q for the mean square, carried
                    # through the averages unchanged (convex combinations).
                    got_m, got_q = stats.mean[(sid, name, c)], stats.second[(sid, name, c)]
                    assert abs(got_m - m) <= 2 * U32 * a * (1 + 1e-9) + 1e-300, (t, sid, name, c)
                    assert abs(got_q - q) <= 4 * U32 * q * (1 + 1e-9) + 1e-300, (t, sid, name, c)
                m = np.array([moments[(s, name, c)][0] for s in sids])
                q = np.array([moments[(s, name, c)][1] for s in sids])
                current = huffman_tree(np.maximum(q - m * m, config.eps))
                previous = chosen.get((name, c))
                if refresh or previous is None or previous[0] != tuple(sids):
                    changed = previous is not None and previous[1] != current
                    rechosen_on_refresh += refresh and changed
                    rechosen_for_new_set += not refresh and changed
                    chosen[(name, c)] = (tuple(sids), current)
                else:
                    kept_although_stats_moved += previous[1] != current
                ids, tree = chosen[(name, c)]
                assert stats.chosen[(name, c)][0] == ids, (t, name, c)
                assert stats.chosen[(name, c)][2] == tree, (t, name, c)
    # Not vacuous: the statistics alone would have changed a kept tree, and both a
    # refresh and a new client set (of the same size too) did change one.
    assert kept_although_stats_moved > 0 and rechosen_on_refresh > 0
    assert rechosen_for_new_set > 0


# ------------------------------------------------------------------------- downlink

DOWNLINK_ROUNDS = 10


def _broadcast_model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "w": rng.normal(size=(40, 30)).astype(np.float32),  # a coded difference
        "b": rng.normal(size=6).astype(np.float32),  # too small for any codec to pay: raw
        "count": rng.integers(0, 100, size=1),  # an integer buffer: raw
    }


@pytest.mark.parametrize("initial", ["sent", "seeded"])
def test_downlink_versions_history_and_catch_up_follow_their_definitions(initial: str) -> None:
    """docs/downlink.md: after t steps the replica is at version t, step t leads from
    t - 1 to t; the history keeps the latest steps as long as together they weigh at
    most one full model (older ones could never be cheaper than x_hat); a client that
    confirmed version v is sent exactly the steps v + 1..t when all of them are still
    held and weigh less than the model, nothing when it is current, and x_hat in full
    (None) otherwise; a version is vouched for exactly when it is the current one or
    the target of a held step, with that step's checksum. A client the server knows
    nothing of starts from the initial model it builds itself ("seeded") or gets x_hat
    in full ("sent"), and one it was told to forget always gets x_hat in full."""
    spec = parse_downlink({"name": "uniform", "bits": 4, "block": 256, "initial": initial})
    server = BroadcastServer(spec, TensorPolicy(), 7)
    rng = np.random.default_rng(11)
    model = _broadcast_model(rng)
    server.start(model)
    full = sum(a.nbytes for a in model.values())
    steps, checksums = [], {0: server.checksum}
    evicted_full = caught_up = 0
    for t in range(1, DOWNLINK_ROUNDS + 1):
        step = server.advance(_broadcast_model(rng))
        assert (step.source, step.target, server.version) == (t - 1, t, t)
        assert server.checksum == step.checksum
        steps.append(step)
        checksums[t] = step.checksum
        held, weight = [], 0
        for s in reversed(steps):  # the longest run of latest steps within one model
            if weight + s.nbytes > full:
                break
            held.insert(0, s)
            weight += s.nbytes
        assert [s.target for s in server.history] == [s.target for s in held]
        assert all(a is b for a, b in zip(server.history, held, strict=True))
        oldest_held = held[0].source if held else t
        for v in range(t + 1):
            client = 1000 * t + v
            server.confirmed[client] = v
            missing = steps[v:]  # the steps with targets v + 1..t
            if v == t:
                want = []
            elif v >= oldest_held and sum(s.nbytes for s in missing) < full:
                want = missing
            else:
                want = None
            got = server.steps_for(client)
            if want is None:
                assert got is None, (t, v)
                evicted_full += 1
            else:
                assert got is not None and [s.target for s in got] == [s.target for s in want]
                assert all(a is b for a, b in zip(got, want, strict=True)), (t, v)
                caught_up += bool(want)
            vouched = v == t or v in {s.target for s in held}
            assert server.confirm(client, v, checksums[v]) is vouched, (t, v)
            assert server.confirm(client, v, "0" * 16) is False  # a replica never held
        stranger = 10**6 + t
        unknown = server.steps_for(stranger)
        if initial == "seeded":  # as if it had confirmed version 0
            server.confirmed[stranger] = 0
            assert unknown == server.steps_for(stranger)
            server.forget(stranger)
            assert server.steps_for(stranger) is None
        else:
            assert unknown is None
    # Not vacuous: steps were dropped from the history and clients caught up by steps.
    assert len(server.history) < DOWNLINK_ROUNDS and evicted_full > 0 and caught_up > 0
